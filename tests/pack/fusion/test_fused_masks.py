"""Keras masks (`Embedding(mask_zero=True)`, `Masking`) flow through fused graphs as in members."""

import keras
import numpy as np
import pytest
from fusion_models import gradients
from keras import layers, ops

from keras_gpushare.pack.fusion import build_fused_model, fusion_report

N = 3
RNG = np.random.default_rng(0)
TOKENS = RNG.integers(1, 12, size=(4, 7)).astype("int32")
TOKENS[:, 5:] = 0
TOKENS[1, :3] = 0
STEPS = RNG.normal(size=(4, 6, 3)).astype("float32")
STEPS[:, 4:] = 0.0
STEPS[2, 1] = 0.0


def tokens_model(seed, mask_zero=True):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((7,), dtype="int32")
    e = layers.Dropout(0.2)(layers.Embedding(12, 6, mask_zero=mask_zero)(tokens))
    h = layers.LayerNormalization()(layers.Dense(5, activation="tanh")(e))
    h = layers.GlobalAveragePooling1D()(layers.Add()([h, layers.Dense(5)(e)]))
    plain = layers.GlobalMaxPooling1D()(layers.Dense(4)(layers.Embedding(12, 4)(tokens)))
    return keras.Model(tokens, layers.Dense(2)(layers.Concatenate()([h, plain])))


def masking_model(seed):
    keras.utils.set_random_seed(seed)
    steps = keras.Input((6, 3))
    h = layers.Dense(4, activation="relu")(layers.Masking()(steps))
    return keras.Model(steps, layers.GlobalAveragePooling1D()(h))


CASES = {"tokens": (tokens_model, TOKENS), "masking": (masking_model, STEPS)}


@pytest.mark.parametrize("input_mode", ["replicate", "stacked"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_masked_members_fuse_and_match(case, input_mode):
    build, x = CASES[case]
    members = [build(seed) for seed in range(N)]
    report = fusion_report(members)
    assert report.fusable, str(report)
    # The ops computing masks are not layer calls of their own in the report.
    assert all(v.type[0].isupper() and "Equal" not in v.type for v in report.layers)
    fused = build_fused_model(members, input_mode=input_mode)
    out = np.asarray(fused(x if input_mode == "replicate" else np.stack([x] * N)))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(x)), atol=2e-5, rtol=1e-5)


def test_the_mask_changes_the_result():
    # Without the mask the pooled mean differs: the comparison above checks masking.
    masked, unmasked = tokens_model(0), tokens_model(0, mask_zero=False)
    assert not np.allclose(np.asarray(masked(TOKENS)), np.asarray(unmasked(TOKENS)), atol=1e-3)


def test_masked_gradients_match_members():
    members = [tokens_model(seed) for seed in range(N)]
    fused = build_fused_model(members)
    pairs = fused.member_variable_map(members)
    trainable = [f for f, _ in pairs if f.trainable]
    fused_grads = gradients(lambda: ops.sum(ops.square(fused(TOKENS))), trainable)
    for i, member in enumerate(members):
        variables = [m[i][0] for f, m in pairs if f.trainable]
        grads = gradients(lambda member=member: ops.sum(ops.square(member(TOKENS))), variables)
        for fused_grad, grad in zip(fused_grads, grads):
            np.testing.assert_allclose(fused_grad[i], grad, atol=1e-5, rtol=1e-4)


def test_masked_fused_model_saves_and_loads(tmp_path):
    members = [tokens_model(seed) for seed in range(N)]
    fused = build_fused_model(members)
    path = str(tmp_path / "masked.keras")
    fused.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(np.asarray(loaded(TOKENS)), np.asarray(fused(TOKENS)), atol=1e-6)
