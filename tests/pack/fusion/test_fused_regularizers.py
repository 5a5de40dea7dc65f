"""Regularizer strengths are per-member data; one odd member does not unfuse the others.

Members whose L1/L2/L1L2 strengths differ (a search over regularization; a member without a
regularizer has strength 0) fuse into one group, and each member's logged loss and weights
equal its own `fit`, where Keras adds `sum(model.losses)` to the compiled loss. A member that
fuses with none of the others (a custom regularizer, another kernel size) forms its own
group (on TensorFlow a member alone trains on the graph engine), and the rest stay fused.
Backend-neutral (the Makefile reruns tests/pack/fusion on JAX).
"""

import keras
import numpy as np
import pytest
from keras import layers

import keras_gpushare as kg
from keras_gpushare.pack.fusion import build_fused_model

TENSORFLOW = keras.backend.backend() == "tensorflow"
RNG = np.random.default_rng(0)
X = RNG.normal(size=(96, 10)).astype("float32")
Y = RNG.normal(size=(96, 1)).astype("float32")
IMAGES = RNG.normal(size=(96, 6, 6, 2)).astype("float32")
L1, L2, L1L2 = keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2


@keras.saving.register_keras_serializable(package="test_fused_regularizers")
class SquaredSum(keras.regularizers.Regularizer):
    """Not L1/L2: a regularizer of the user's own."""

    def __init__(self, strength=0.01):
        self.strength = strength

    def __call__(self, x):
        return self.strength * keras.ops.square(keras.ops.sum(x))

    def get_config(self):
        return {"strength": self.strength}


def mlp(seed, width, kernel=None, bias=None, hidden_bias=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((10,)),
            layers.Dense(
                width, activation="relu", kernel_regularizer=kernel, bias_regularizer=bias
            ),
            layers.Dense(1, bias_regularizer=hidden_bias),
        ]
    )


def cnn(seed, filters, kernel_size=3, kernel=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            layers.Conv2D(filters, kernel_size, padding="same", kernel_regularizer=kernel),
            layers.Flatten(),
            layers.Dense(1),
        ]
    )


STRENGTHS = {
    # Four widths, one member without a regularizer (strength 0), the others at 3 strengths.
    "l2_search": lambda: [
        mlp(0, 16),
        mlp(1, 24, kernel=L2(0.001)),
        mlp(2, 40, kernel=L2(0.01)),
        mlp(3, 48, kernel=L2(0.1)),
    ],
    "mixed_kinds": lambda: [
        mlp(0, 6, kernel=L1(0.02), bias=L2(0.05)),
        mlp(1, 9, kernel=L1L2(0.01, 0.03), hidden_bias=L1(0.1)),
        mlp(2, 6, kernel=L2(0.2)),
    ],
    "convolutions": lambda: [cnn(0, 4, kernel=L2(0.05)), cnn(1, 8), cnn(2, 6, kernel=L1(0.01))],
}


def optimizers(n):
    return [
        keras.optimizers.SGD(0.02),
        keras.optimizers.Adam(0.01),
        keras.optimizers.SGD(0.01, momentum=0.9),
        keras.optimizers.RMSprop(0.005),
        keras.optimizers.Adam(0.003),
    ][:n]


def fit(model, x):
    return model.fit(x, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)


def assert_trains_as_alone(pack, build, x):
    history = fit(pack, x)
    for i, (twin, optimizer) in enumerate(zip(build(), optimizers(len(pack.members)))):
        twin.compile(optimizer=optimizer, loss="mse")
        alone = fit(twin, x)
        for a, b in zip(pack.members[i].get_weights(), twin.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], alone.history["loss"], rtol=1e-5)


def groups(pack):
    return sorted(sorted(engine.member_ids) for engine in pack._gradient_engines)


@pytest.mark.parametrize("case", sorted(STRENGTHS))
def test_members_of_different_regularizer_strengths_fuse_and_train_as_alone(case):
    build = STRENGTHS[case]
    x = IMAGES if case == "convolutions" else X
    pack = kg.ModelPack(build(), fuse=True)
    assert groups(pack) == [list(range(len(pack.members)))], pack.fusion_report
    pack.compile(optimizer=optimizers(len(pack.members)), loss="mse")
    assert_trains_as_alone(pack, build, x)


def test_the_fused_model_holds_each_members_own_penalty():
    members = STRENGTHS["mixed_kinds"]()
    fused = build_fused_model(members)
    total = sum(float(keras.ops.sum(keras.ops.stack(m.losses))) for m in members)
    np.testing.assert_allclose(float(keras.ops.sum(keras.ops.stack(fused.losses))), total, 1e-6)


@pytest.mark.skipif(not TENSORFLOW, reason="a member that fuses alone needs the graph engine")
@pytest.mark.parametrize("odd", ["custom_regularizer", "activity_regularizer"])
def test_a_member_with_a_regularizer_that_does_not_fuse_leaves_the_others_fused(odd):
    def build():
        members = [mlp(i, w, kernel=L2(0.01 * i)) for i, w in enumerate((16, 24, 40, 48))]
        keras.utils.set_random_seed(9)
        if odd == "custom_regularizer":
            members.insert(2, mlp(9, 32, kernel=SquaredSum(0.01)))
        else:
            dense = layers.Dense(32, activation="relu", activity_regularizer=L2(0.01))
            members.insert(2, keras.Sequential([keras.Input((10,)), dense, layers.Dense(1)]))
        return members

    pack = kg.ModelPack(build())
    assert pack.engine == "mixed" and groups(pack) == [[0, 1, 3, 4]], pack.fusion_report
    assert pack.engine_plan.graph == (2,)
    pack.compile(optimizer=optimizers(5), loss="mse")
    assert_trains_as_alone(pack, build, X)


def test_a_member_with_another_kernel_size_forms_its_own_group():
    def build():
        return [cnn(i, f) for i, f in enumerate((4, 8, 16, 12))] + [cnn(7, 8, kernel_size=5)]

    pack = kg.ModelPack(build())
    if TENSORFLOW:
        assert groups(pack) == [[0, 1, 2, 3]] and pack.engine_plan.graph == (4,)
        assert "member 4 on the graph engine: it fuses with no other member" in pack.fusion_report
        assert "config differs in member 4: kernel_size" in pack.fusion_report
    else:
        assert groups(pack) == [[0, 1, 2, 3], [4]], pack.fusion_report
    pack.compile(optimizer=optimizers(5), loss="mse")
    assert_trains_as_alone(pack, build, IMAGES)
