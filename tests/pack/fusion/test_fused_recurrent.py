"""Fused LSTM, GRU and SimpleRNN compute and train exactly as each member alone.

Backend-neutral (the Makefile reruns tests/pack/fusion on JAX). The reference is always
the member model itself: its outputs, and its weights after plain `fit` on the same batches.
"""

import keras
import numpy as np
import pytest
from fusion_models import assert_members_match_twins, twins_of
from keras import layers

import keras_gpushare as kg
from keras_gpushare.pack.fusion import build_fused_model, fusion_report
from keras_gpushare.pack.fusion.layers_recurrent import FusedSimpleRNN

N = 2
RNG = np.random.default_rng(0)
TOKENS = RNG.integers(1, 10, size=(5, 6)).astype("int32")
TOKENS[:, 4:] = 0  # right padding
TOKENS[1, :2] = 0  # and a left-padded row
SERIES = RNG.normal(size=(5, 6, 3)).astype("float32")
SERIES[0, 3:] = 0.0
SERIES[2, 1] = 0.0


def recurrent(seed, kind="LSTM", masked=True, **options):
    """Two stacked recurrent layers on masked tokens (or a `Masking`ed series)."""
    keras.utils.set_random_seed(seed)
    rnn = getattr(layers, kind)
    if masked == "masking":
        inputs = keras.Input((6, 3))
        h = layers.Masking()(inputs)
    else:
        inputs = keras.Input((6,), dtype="int32")
        h = layers.Embedding(10, 4, mask_zero=masked)(inputs)
    first = {k: v for k, v in options.items() if k != "return_state"}
    h = rnn(5, return_sequences=True, **first)(h)
    outputs = rnn(3, **options)(h)
    if options.get("return_state"):
        outputs = layers.Concatenate()(list(outputs))
    return keras.Model(inputs, layers.Dense(1)(outputs))


CASES = {
    # name: (layer, options, mask source, input mode)
    "lstm": ("LSTM", {}, True, "replicate"),
    "lstm_backwards_state": ("LSTM", {"go_backwards": True, "return_state": True}, True, "stacked"),
    "lstm_dropout_unmasked": (
        "LSTM",
        {"dropout": 0.3, "recurrent_dropout": 0.3},
        False,
        "replicate",
    ),
    "gru": ("GRU", {}, "masking", "replicate"),
    "gru_reset_before": ("GRU", {"reset_after": False, "go_backwards": True}, True, "replicate"),
    "gru_reset_before_dropout": (
        "GRU",
        {"reset_after": False, "recurrent_dropout": 0.3},
        True,
        "stacked",
    ),
    "gru_no_bias_state": ("GRU", {"use_bias": False, "return_state": True}, "masking", "replicate"),
    "simple_rnn_dropout": (
        "SimpleRNN",
        {"dropout": 0.2, "recurrent_dropout": 0.2},
        True,
        "stacked",
    ),
    "simple_rnn_relu_state": (
        "SimpleRNN",
        {"activation": "relu", "return_state": True},
        False,
        "replicate",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_members(case):
    kind, options, masked, input_mode = CASES[case]
    members = [recurrent(seed, kind, masked, **options) for seed in range(N)]
    report = fusion_report(members)
    assert report.fusable, str(report)
    x = SERIES if masked == "masking" else TOKENS
    fused = build_fused_model(members, input_mode=input_mode)
    out = np.asarray(fused(x if input_mode == "replicate" else np.stack([x] * N)))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(x)), atol=2e-5, rtol=1e-5)
    assert not np.allclose(out[0], out[1])


def test_initial_state_argument():
    def build(seed):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((6, 3))
        _, h, c = layers.LSTM(4, return_state=True)(inputs)
        decoded = layers.LSTM(4, return_sequences=True)(inputs, initial_state=[h, c])
        return keras.Model(inputs, layers.GRU(2, go_backwards=True)(decoded))

    members = [build(seed) for seed in range(N)]
    fused = build_fused_model(members)
    out = np.asarray(fused(SERIES))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(SERIES)), atol=2e-5)


def stacked_kinds(seed):
    """LSTM, GRU and SimpleRNN in one member, on masked tokens."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6,), dtype="int32")
    h = layers.Embedding(10, 4, mask_zero=True)(tokens)
    h = layers.LSTM(5, return_sequences=True)(h)
    h = layers.GRU(4, return_sequences=True, reset_after=False, go_backwards=True)(h)
    outputs = layers.SimpleRNN(3, return_state=True)(h)
    return keras.Model(tokens, layers.Dense(1)(layers.Concatenate()(list(outputs))))


def test_pack_trains_like_members_alone(tmp_path):
    x = np.concatenate([TOKENS] * 4)
    y = np.random.default_rng(1).normal(size=(len(x), 1)).astype("float32")
    members = [stacked_kinds(seed) for seed in range(2)]
    twins = twins_of(members)
    pack = kg.ModelPack(members)
    assert pack.engine == "fused", pack.fusion_report

    # SGD: on TensorFlow, Adam on an Embedding's sparse gradient differs from the dense
    # update (docs/fusion.md).
    def sgd(rate):
        return keras.optimizers.SGD(rate, momentum=0.9)

    rates = (0.02, 0.005)
    # On TensorFlow, skip XLA's compile time (the attention tests train with XLA); on JAX
    # steps without XLA would compile every loop anew.
    jit = "auto" if keras.backend.backend() == "jax" else False
    pack.compile(optimizer=[sgd(r) for r in rates], loss="mse", jit_compile=jit)
    pack.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for twin, rate in zip(twins, rates):
        twin.compile(optimizer=sgd(rate), loss="mse")
        twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_members_match_twins(pack, twins, x, str(tmp_path / "member.keras"), saved=1)


def _identity_rnn(dropout=0.0, recurrent_dropout=0.0, units=64):
    """A linear SimpleRNN whose outputs show its dropout masks directly."""
    config = layers.SimpleRNN(
        units,
        activation=None,
        use_bias=False,
        return_sequences=True,
        dropout=dropout,
        recurrent_dropout=recurrent_dropout,
        seed=3,
    ).get_config()
    layer = FusedSimpleRNN(n_members=N, member_config=config, input_stacked=False)
    layer.build((None, 4, units))
    return layer


def test_input_dropout_masks_are_per_member_and_fixed_over_time():
    layer = _identity_rnn(dropout=0.25)
    layer.kernel.assign(np.stack([np.eye(64, dtype="float32")] * N))
    layer.recurrent_kernel.assign(np.zeros((N, 64, 64), "float32"))
    ones = np.ones((256, 4, 64), "float32")
    out = np.asarray(layer(ones, training=True))  # output_t = mask * x_t
    for t in range(1, 4):
        np.testing.assert_array_equal(out[:, :, t], out[:, :, 0])
    np.testing.assert_allclose(np.unique(out), [0.0, 1 / 0.75], rtol=1e-6)
    assert abs((out > 0).mean() - 0.75) < 0.01
    assert not np.array_equal(out[0] > 0, out[1] > 0)
    np.testing.assert_array_equal(np.asarray(layer(ones, training=False)), ones[None].repeat(N, 0))


def test_recurrent_dropout_masks_are_per_member_and_fixed_over_time():
    layer = _identity_rnn(recurrent_dropout=0.5)
    layer.kernel.assign(np.zeros((N, 64, 64), "float32"))
    layer.recurrent_kernel.assign(np.stack([np.eye(64, dtype="float32")] * N))
    zeros = np.zeros((256, 4, 64), "float32")
    start = np.ones((N, 256, 64), "float32")
    out = np.asarray(layer(zeros, initial_state=start, training=True))  # h_t = mask ** t
    np.testing.assert_allclose(out[:, :, 1], out[:, :, 0] ** 2, rtol=1e-6)
    np.testing.assert_allclose(np.unique(out[:, :, 0]), [0.0, 2.0])
    assert abs((out[:, :, 0] > 0).mean() - 0.5) < 0.01
    assert not np.array_equal(out[0, :, 0] > 0, out[1, :, 0] > 0)


def test_stateful_members_are_refused():
    def build(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((6, 3), batch_size=5), layers.GRU(3, stateful=True)])

    assert "`stateful=True`" in str(fusion_report([build(0), build(1)]))


def test_the_benchmark_forecasters_fuse():
    # benchmarks/sequence.py: 16 LSTM forecasters, 24 steps of 4 features, 16 units.
    def forecaster(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((24, 4)), layers.LSTM(16), layers.Dense(1)])

    pack = kg.ModelPack([forecaster(seed) for seed in range(16)], fuse="auto")
    assert pack.engine == "fused", pack.fusion_report
