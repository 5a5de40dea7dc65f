"""Random layers without weights draw per member; Rescaling folds like other per-sample layers."""

import keras
import numpy as np
import pytest
from keras import layers

from keras_gpushare.pack.fusion import build_fused_model, fusion_report

RANDOM = {
    "spatial_dropout": (layers.SpatialDropout1D(0.5), (6, 8)),
    "gaussian_noise": (layers.GaussianNoise(0.5), (6, 8)),
    "gaussian_dropout": (layers.GaussianDropout(0.5), (6, 8)),
}


@pytest.mark.parametrize("case", sorted(RANDOM))
def test_random_layers_draw_per_member_and_pass_through_at_inference(case):
    layer, shape = RANDOM[case]
    members = [keras.Sequential([keras.Input(shape), layer]) for _ in range(2)]
    assert fusion_report(members).fusable
    fused = build_fused_model(members)  # a shared input: each member must still draw its own
    x = np.ones((64, *shape), "float32")
    np.testing.assert_array_equal(np.asarray(fused(x)), np.stack([x, x]))
    out = np.asarray(fused(x, training=True))
    assert not np.allclose(out[0], out[1])
    if case == "spatial_dropout":  # one mask per sample and channel, shared over steps
        np.testing.assert_array_equal(out[:, :, 0], out[:, :, 3])
        np.testing.assert_allclose(np.unique(out), [0.0, 2.0])


def test_rescaling_matches_members():
    def build(seed):
        keras.utils.set_random_seed(seed)
        images = keras.Input((4, 4, 1))
        h = layers.Rescaling(1 / 255.0, offset=-0.5)(images)
        return keras.Model(images, layers.Dense(2)(layers.Flatten()(h)))

    members = [build(seed) for seed in range(2)]
    x = np.random.default_rng(0).integers(0, 256, size=(3, 4, 4, 1)).astype("float32")
    out = np.asarray(build_fused_model(members)(x))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(x)), atol=1e-5)
