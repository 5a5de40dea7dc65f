"""Fused Bidirectional and TimeDistributed compute and train exactly as each member alone."""

import keras
import numpy as np
import pytest
from fusion_models import assert_members_match_twins, twins_of
from keras import layers

import keras_gpushare as kg
from keras_gpushare.pack.fusion import build_fused_model, fusion_report

N = 2
RNG = np.random.default_rng(0)
TOKENS = RNG.integers(1, 10, size=(5, 6)).astype("int32")
TOKENS[:, 4:] = 0
TOKENS[2, :1] = 0
SERIES = RNG.normal(size=(5, 6, 3)).astype("float32")
SERIES[1, 4:] = 0.0


def bidirectional(seed, kind="LSTM", merge_mode="concat", sequences=True, state=False):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6,), dtype="int32")
    h = layers.Embedding(10, 4, mask_zero=True)(tokens)
    rnn = getattr(layers, kind)(3, return_sequences=sequences, return_state=state)
    outputs = layers.Bidirectional(rnn, merge_mode=merge_mode)(h)
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    if sequences:
        outputs = [layers.GlobalAveragePooling1D()(o) if len(o.shape) == 3 else o for o in outputs]
    merged = outputs[0] if len(outputs) == 1 else layers.Concatenate()(outputs)
    return keras.Model(tokens, layers.Dense(1)(merged))


CASES = {
    "lstm_concat_sequences": ("LSTM", "concat", True, False, "replicate"),
    "lstm_sum_last_state": ("LSTM", "sum", False, True, "stacked"),
    "gru_ave_sequences_state": ("GRU", "ave", True, True, "replicate"),
    "gru_mul_last": ("GRU", "mul", False, False, "stacked"),
    "simple_rnn_none_sequences": ("SimpleRNN", None, True, False, "replicate"),
    "lstm_none_last_state": ("LSTM", None, False, True, "replicate"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bidirectional_forward_matches_members(case):
    kind, merge_mode, sequences, state, input_mode = CASES[case]
    members = [bidirectional(s, kind, merge_mode, sequences, state) for s in range(N)]
    report = fusion_report(members)
    assert report.fusable, str(report)
    fused = build_fused_model(members, input_mode=input_mode)
    x = TOKENS if input_mode == "replicate" else np.stack([TOKENS] * N)
    out = np.asarray(fused(x))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(TOKENS)), atol=2e-5, rtol=1e-5)


def distributed(seed):
    keras.utils.set_random_seed(seed)
    frames = keras.Input((6, 4, 2))
    h = layers.TimeDistributed(layers.Conv1D(3, 2, activation="relu"))(frames)
    h = layers.TimeDistributed(layers.Flatten())(h)
    h = layers.TimeDistributed(layers.Dropout(0.3))(h)
    h = layers.TimeDistributed(layers.Dense(5))(h)
    return keras.Model(frames, layers.GRU(2)(h))


@pytest.mark.parametrize("input_mode", ["replicate", "stacked"])
def test_time_distributed_forward_matches_members(input_mode):
    frames = RNG.normal(size=(5, 6, 4, 2)).astype("float32")
    members = [distributed(s) for s in range(N)]
    assert fusion_report(members).fusable, str(fusion_report(members))
    fused = build_fused_model(members, input_mode=input_mode)
    x = frames if input_mode == "replicate" else np.stack([frames] * N)
    out = np.asarray(fused(x))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(frames)), atol=2e-5, rtol=1e-5)
    training = np.asarray(fused(x, training=True))
    assert training.shape == out.shape and not np.allclose(training, out)


def encoder(seed, tagger=False):
    """Masked series, a per-step projection, a bidirectional layer."""
    keras.utils.set_random_seed(seed)
    series = keras.Input((6, 3))
    h = layers.TimeDistributed(layers.Dense(4, activation="tanh"))(layers.Masking()(series))
    h = layers.Bidirectional(layers.LSTM(3, return_sequences=tagger), merge_mode="sum")(h)
    return keras.Model(series, layers.Dense(1)(h))


def test_pack_trains_like_members_alone(tmp_path):
    x = np.concatenate([SERIES] * 4)
    y = np.random.default_rng(1).normal(size=(len(x), 1)).astype("float32")
    members = [encoder(s) for s in range(2)]
    twins = twins_of(members)
    pack = kg.ModelPack(members)
    assert pack.engine == "fused", pack.fusion_report
    rates = (0.02, 0.005)
    # On TensorFlow, skip XLA's compile time (the attention tests train with XLA).
    jit = "auto" if keras.backend.backend() == "jax" else False
    pack.compile(optimizer=[keras.optimizers.Adam(r) for r in rates], loss="mse", jit_compile=jit)
    pack.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for twin, rate in zip(twins, rates):
        twin.compile(optimizer=keras.optimizers.Adam(rate), loss="mse")
        twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_members_match_twins(pack, twins, x, str(tmp_path / "member.keras"), saved=0)


def test_masked_outputs_are_refused():
    # Plain Keras leaves masked steps out of the loss; the fused engine would not.
    report = fusion_report([encoder(0, tagger=True), encoder(1, tagger=True)])
    assert "carries a Keras mask" in str(report) and not report.fusable


def test_unsupported_wrapped_layers_are_named():
    def build(layer, shape):
        return keras.Sequential([keras.Input(shape), layer])

    normalized = [build(layers.TimeDistributed(layers.BatchNormalization()), (6, 3))] * 2
    assert "keeps statistics per time step" in str(fusion_report(normalized))
    unknown = [build(layers.TimeDistributed(layers.PReLU()), (6, 3))] * 2
    assert "the layer `PReLU` it wraps has no fused form" in str(fusion_report(unknown))
