"""Fused MultiHeadAttention computes and trains exactly as each member alone."""

import keras
import numpy as np
import pytest
from fusion_models import assert_members_match_twins, twins_of
from keras import layers

import keras_gpushare as kg
from keras_gpushare.pack.fusion import build_fused_model, fusion_report

N = 2
RNG = np.random.default_rng(0)
TOKENS = RNG.integers(1, 11, size=(4, 7)).astype("int32")
TOKENS[:, 5:] = 0
TOKENS[1, :2] = 0
PAIRS = (RNG.random((4, 7, 7)) > 0.3).astype("float32")


def block(seed, mask_zero=True, causal=False, dropout=0.0, scores=False, cross=False, **kw):
    """Token embedding, one attention block, pooling: the members of these tests."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((7,), dtype="int32")
    pairs = keras.Input((7, 7))
    e = layers.Embedding(11, 8, mask_zero=mask_zero)(tokens)
    mha = layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=dropout, **kw)
    context = layers.Dense(6)(e) if cross else e
    key = layers.Dense(5)(e) if cross else None
    attention_mask = pairs if kw.pop("with_attention_mask", False) else None
    a = mha(
        e,
        context,
        key=key,
        attention_mask=attention_mask,
        use_causal_mask=causal,
        return_attention_scores=scores,
    )
    extra = []
    if scores:
        a, s = a
        extra = [layers.GlobalAveragePooling2D()(s)]
    h = layers.LayerNormalization()(layers.Add()([e, a]))
    h = (
        layers.Concatenate()([layers.GlobalAveragePooling1D()(h), *extra])
        if extra
        else (layers.GlobalAveragePooling1D()(h))
    )
    return keras.Model([tokens, pairs], layers.Dense(2)(h))


CASES = {
    # name: (block options, input mode)
    "masked": ({}, "replicate"),
    "masked_causal": ({"causal": True}, "stacked"),
    "causal_unmasked": ({"causal": True, "mask_zero": False}, "replicate"),
    "dropout_at_inference": ({"dropout": 0.3, "value_dim": 3}, "stacked"),
    "scores": ({"scores": True}, "replicate"),
    "cross_attention_with_key": ({"cross": True}, "replicate"),
    "sliding_window_output_shape": ({"sliding_window": 2, "output_shape": 8}, "stacked"),
    "no_bias_causal_scores": ({"use_bias": False, "causal": True, "scores": True}, "stacked"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_members(case):
    options, input_mode = CASES[case]
    members = [block(seed, **options) for seed in range(N)]
    report = fusion_report(members)
    assert report.fusable, str(report)
    fused = build_fused_model(members, input_mode=input_mode)
    x = [TOKENS, PAIRS]
    out = np.asarray(fused(x if input_mode == "replicate" else [np.stack([a] * N) for a in x]))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(x)), atol=2e-5, rtol=1e-5)


def test_attention_mask_argument():
    def build(seed):
        keras.utils.set_random_seed(seed)
        tokens, pairs = keras.Input((7, 4)), keras.Input((7, 7))
        a = layers.MultiHeadAttention(2, 3)(tokens, tokens, attention_mask=pairs)
        return keras.Model([tokens, pairs], layers.GlobalMaxPooling1D()(a))

    members = [build(seed) for seed in range(N)]
    fused = build_fused_model(members)
    x = [RNG.normal(size=(4, 7, 4)).astype("float32"), PAIRS]
    out = np.asarray(fused(x))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(x)), atol=2e-5)


def test_two_attention_axes():
    def build(seed):
        keras.utils.set_random_seed(seed)
        grid = keras.Input((3, 4, 5))
        a = layers.MultiHeadAttention(2, 3, attention_axes=(1, 2))(grid, grid)
        return keras.Model(grid, layers.GlobalAveragePooling2D()(a))

    members = [build(seed) for seed in range(N)]
    fused = build_fused_model(members, input_mode="stacked")
    grid = RNG.normal(size=(4, 3, 4, 5)).astype("float32")
    out = np.asarray(fused(np.stack([grid] * N)))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(grid)), atol=2e-5)


def test_attention_dropout_is_drawn_per_member():
    members = [block(0, dropout=0.5) for _ in range(N)]  # identical weights
    fused = build_fused_model(members)
    x = [TOKENS, PAIRS]
    inference = np.asarray(fused(x))
    np.testing.assert_allclose(inference[0], inference[1], atol=1e-6)
    training = np.asarray(fused(x, training=True))
    assert not np.allclose(training[0], training[1])
    assert not np.allclose(training[0], inference[0])


def test_pack_trains_like_members_alone(tmp_path):
    x = [np.concatenate([TOKENS] * 4), np.concatenate([PAIRS] * 4)]
    y = np.random.default_rng(1).integers(0, 2, size=(len(x[0]),))
    members = [block(seed, causal=True) for seed in range(2)]
    twins = twins_of(members)
    pack = kg.ModelPack(members)
    assert pack.engine == "fused", pack.fusion_report

    # SGD: on TensorFlow, Adam on an Embedding's sparse gradient differs from the dense
    # update (docs/fusion.md).
    def sgd(rate):
        return keras.optimizers.SGD(rate, momentum=0.9)

    rates = (0.05, 0.01)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pack.compile(optimizer=[sgd(r) for r in rates], loss=loss, metrics=["accuracy"])
    history = pack.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for i, (twin, rate) in enumerate(zip(twins, rates)):
        twin.compile(optimizer=sgd(rate), loss=loss, metrics=["accuracy"])
        alone = twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], alone.history["loss"], 1e-5)
    assert_members_match_twins(pack, twins, x, str(tmp_path / "member.keras"), saved=1)


def test_gated_attention_is_refused():
    members = [block(seed, use_gate=True) for seed in range(2)]
    assert "`use_gate=True`" in str(fusion_report(members))


def test_the_benchmark_transformers_fuse():
    # benchmarks/sequence.py: 8 classifiers, Embedding, one attention block, LayerNorm, pooling.
    def classifier(seed):
        keras.utils.set_random_seed(seed)
        tokens = keras.Input((32,), dtype="int32")
        x = layers.Embedding(1000, 32)(tokens)
        attended = layers.MultiHeadAttention(num_heads=2, key_dim=16)(x, x)
        x = layers.LayerNormalization()(layers.Add()([x, attended]))
        x = layers.GlobalAveragePooling1D()(x)
        return keras.Model(tokens, layers.Dense(2, activation="softmax")(x))

    pack = kg.ModelPack([classifier(seed) for seed in range(8)], fuse="auto")
    assert pack.engine == "fused", pack.fusion_report
