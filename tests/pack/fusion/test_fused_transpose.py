"""Fused Conv1DTranspose and Conv2DTranspose compute and train exactly as each member alone."""

import keras
import numpy as np
import pytest
from fusion_models import twins_of
from keras import layers

import keras_gpushare as kg
from keras_gpushare.pack.fusion import build_fused_model, fusion_report

N = 2
RNG = np.random.default_rng(0)
IMAGES = RNG.normal(size=(3, 5, 6, 2)).astype("float32")
SIGNALS = RNG.normal(size=(3, 7, 2)).astype("float32")

CASES = {
    # name: (layer, options)
    "2d_valid": ("Conv2DTranspose", {"kernel_size": 3}),
    "2d_same_stride": ("Conv2DTranspose", {"kernel_size": 3, "strides": 2, "padding": "same"}),
    "2d_output_padding": (
        "Conv2DTranspose",
        {"kernel_size": (2, 3), "strides": (3, 2), "output_padding": (1, 0)},
    ),
    "2d_dilated": ("Conv2DTranspose", {"kernel_size": 2, "dilation_rate": 2, "padding": "same"}),
    "1d_stride": ("Conv1DTranspose", {"kernel_size": 4, "strides": 2, "activation": "relu"}),
    "1d_same_no_bias": (
        "Conv1DTranspose",
        {"kernel_size": 3, "strides": 3, "padding": "same", "use_bias": False},
    ),
}


def decoder(seed, kind, options):
    keras.utils.set_random_seed(seed)
    x = keras.Input(IMAGES.shape[1:] if kind == "Conv2DTranspose" else SIGNALS.shape[1:])
    return keras.Model(x, getattr(layers, kind)(filters=3, **options)(x))


@pytest.mark.parametrize("implementation", ["patches", "grouped"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_members(case, implementation):
    kind, options = CASES[case]
    members = [decoder(seed, kind, options) for seed in range(N)]
    assert fusion_report(members).fusable, str(fusion_report(members))
    x = IMAGES if kind == "Conv2DTranspose" else SIGNALS
    fused = build_fused_model(members)
    for layer in fused.graph.layers:
        if hasattr(layer, "implementation"):
            layer.implementation = implementation
    out = np.asarray(fused(x))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], member_output(member, x), atol=2e-5, rtol=1e-5)


def member_output(member, x):
    """The member's output, checked against the same layer with its dilation written out.

    TensorFlow's CPU kernel for a dilated transposed convolution exists only with oneDNN
    (Intel CPUs with AVX-512); elsewhere (AMD, `TF_ENABLE_ONEDNN_OPTS=0`) the member itself
    raises. There the reference is the undilated layer whose kernel has the dilation's zeros
    written in, which every CPU runs; where the member runs, the two must agree.
    """
    layer = member.layers[-1]
    dilation = tuple(layer.dilation_rate)
    if set(dilation) == {1}:
        return np.asarray(member(x))
    kernel, *bias = layer.get_weights()
    spread = np.zeros(
        tuple((k - 1) * d + 1 for k, d in zip(kernel.shape, dilation)) + kernel.shape[-2:],
        kernel.dtype,
    )
    spread[tuple(slice(None, None, d) for d in dilation)] = kernel
    config = layer.get_config() | {"kernel_size": spread.shape[:-2], "dilation_rate": 1}
    undilated = type(layer).from_config(config)
    undilated.build(x.shape)
    undilated.set_weights([spread, *bias])
    expected = np.asarray(undilated(x))
    try:
        np.testing.assert_allclose(np.asarray(member(x)), expected, atol=2e-5, rtol=1e-5)
    except Exception as error:  # noqa: BLE001 - the one refusal that is allowed is matched
        if "dilation rates larger than 1" not in str(error):
            raise
    return expected


def autoencoder(seed):
    keras.utils.set_random_seed(seed)
    images = keras.Input((8, 8, 1))
    h = layers.Conv2D(4, 3, strides=2, padding="same", activation="relu")(images)
    h = layers.Conv2DTranspose(4, 3, strides=2, padding="same", activation="relu")(h)
    h = layers.UpSampling2D()(layers.MaxPooling2D()(h))
    return keras.Model(images, layers.Conv2D(1, 1)(h))


def test_pack_trains_like_members_alone():
    x = RNG.normal(size=(24, 8, 8, 1)).astype("float32")
    members = [autoencoder(seed) for seed in range(N)]
    twins = twins_of(members)
    pack = kg.ModelPack(members)
    assert pack.engine == "fused", pack.fusion_report
    rates = (0.01, 0.003)
    pack.compile(optimizer=[keras.optimizers.Adam(r) for r in rates], loss="mse")
    pack.fit(x, x, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for twin, rate in zip(twins, rates):
        twin.compile(optimizer=keras.optimizers.Adam(rate), loss="mse")
        twin.fit(x, x, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for member, twin in zip(pack.members, twins):
        for a, b in zip(member.get_weights(), twin.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
