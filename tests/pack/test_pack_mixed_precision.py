"""Mixed precision: each member scales its loss dynamically, exactly as its own fit does.

Member 0's labels are so large that its float16 gradients overflow at the initial loss scale:
its `LossScaleOptimizer` skips those steps and halves its scale, while member 1 trains at the
full scale. The pack must do the same member by member (not skip both, not share one scale).
Backend-neutral (the Makefile reruns this file on JAX).
"""

import keras
import numpy as np
import pytest
from pack_builders import copy_model

import keras_gpushare as kg

TENSORFLOW = keras.backend.backend() == "tensorflow"


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _member(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def _optimizers():
    return [keras.optimizers.SGD(1e-6), keras.optimizers.Adam(1e-3)]


@pytest.mark.parametrize("fuse", ["auto", False])
def test_each_member_keeps_its_own_dynamic_loss_scale(mixed_float16, fuse):
    if fuse is False and not TENSORFLOW:
        pytest.skip("the graph engine runs on TensorFlow only")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = x[:, :2].sum(axis=1, keepdims=True)
    labels = [y * 3000.0, y]
    members = [_member(0), _member(1)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members, fuse=fuse)
    pack.compile(optimizer=_optimizers(), loss="mse")
    history = pack.fit(x, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert pack.status == ["active", "active"]
    for i, (twin, optimizer) in enumerate(zip(twins, _optimizers())):
        twin.compile(optimizer=optimizer, loss="mse")
        alone = twin.fit(x, labels[i], batch_size=16, epochs=2, shuffle=False, verbose=0)
        copy = pack.member(i)
        assert isinstance(copy.optimizer, keras.optimizers.LossScaleOptimizer)
        assert float(copy.optimizer.dynamic_scale) == float(twin.optimizer.dynamic_scale)
        assert int(copy.optimizer.iterations) == int(twin.optimizer.iterations)
        for a, b in zip(copy.get_weights(), twin.get_weights()):
            # float16 compute: the fused step and Keras's layers may round a product
            # differently once (1.9e-6 without XLA on a TensorFlow CPU).
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=4e-6)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], alone.history["loss"], rtol=1e-4)
    # Member 0 overflowed far more often: the members' scales went their own ways.
    scales = [float(pack.member(i).optimizer.dynamic_scale) for i in range(2)]
    assert scales[0] < scales[1]
