"""The fused engine driven directly, without a `ModelPack` around it.

The engine is given its members and options, as the pack gives them: its forward pass
equals each member's own, its losses each member's compiled loss, one step on the stacked
weights each member's own step, a member's weights go in and out of its slices without
touching the others, and resetting a member restarts its rows of the vectorized optimizer
only. Runs on TensorFlow, JAX and torch (the step on TensorFlow and torch).
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_gpushare.pack._status import ACTIVE
from keras_gpushare.pack.engines.base import EngineOptions
from keras_gpushare.pack.engines.fused import FusedEngine
from keras_gpushare.pack.fusion import VectorizedOptimizer

ATOL = 1e-5


def _member(seed, units, activation, optimizer):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(units, activation=activation),
            keras.layers.Dense(2),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _engine():
    members = [
        _member(0, 4, "relu", keras.optimizers.Adam(1e-2)),
        _member(1, 8, "tanh", keras.optimizers.Adam(3e-3)),
        _member(2, 6, "relu", keras.optimizers.SGD(1e-2, momentum=0.9)),
    ]
    return FusedEngine(members, (0, 1, 2), EngineOptions((1, 1, 1))), members


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 5)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")


def test_its_outputs_and_losses_are_the_members_own():
    engine, members = _engine()
    x, y = _data()
    raw = engine.call(x, training=False)
    outputs = engine.member_outputs(raw)
    status = ops.convert_to_tensor(np.full((3,), ACTIVE, "int32"))
    losses, freeze = engine.loss(x, y, raw, None, status, training=False)
    for j, member in enumerate(members):
        np.testing.assert_allclose(
            ops.convert_to_numpy(outputs[j]), ops.convert_to_numpy(member(x)), atol=ATOL
        )
        mse = np.mean((ops.convert_to_numpy(member(x)) - y) ** 2)
        np.testing.assert_allclose(ops.convert_to_numpy(losses)[j], mse, rtol=1e-5)
    assert not np.any(ops.convert_to_numpy(freeze))


def test_a_members_weights_go_in_and_out_of_its_slices_only():
    engine, members = _engine()
    x, _ = _data()
    before = [engine.get_member_weights(j) for j in range(3)]
    other = _member(9, 8, "tanh", keras.optimizers.Adam())
    engine.set_member_weights(1, other.get_weights())
    outputs = engine.member_outputs(engine.call(x, training=False))
    np.testing.assert_allclose(
        ops.convert_to_numpy(outputs[1]), ops.convert_to_numpy(other(x)), atol=ATOL
    )
    for got, want in zip(engine.get_member_weights(1), other.get_weights()):
        np.testing.assert_array_equal(got, want)
    for j in (0, 2):
        for got, want in zip(engine.get_member_weights(j), before[j]):
            np.testing.assert_array_equal(got, want)


def test_resetting_a_member_restarts_its_optimizer_rows_only():
    engine, members = _engine()
    optimizer = VectorizedOptimizer([m.optimizer for m in members])
    variables = engine.fused.trainable_variables
    optimizer.build(variables)
    grads = [ops.ones(v.shape) for v in variables]
    optimizer.apply(grads, variables)
    optimizer.apply(grads, variables)
    slots = [np.array(ops.convert_to_numpy(v)) for v in optimizer.variables]
    engine.reset_member(1, optimizer)
    np.testing.assert_array_equal(ops.convert_to_numpy(optimizer.member_iterations), [2, 0, 2])
    row, member_slots = optimizer.member_slots((0, 1, 2), 1)
    assert member_slots
    for slot in member_slots.values():
        assert not np.any(ops.convert_to_numpy(slot)[row])
    # Member 0's rows of the same (Adam) slots are left as they were.
    changed = {id(v) for v in member_slots.values()}
    for variable, old in zip(optimizer.variables, slots):
        if id(variable) in changed:
            np.testing.assert_array_equal(ops.convert_to_numpy(variable)[0], old[0])


def _gradients(engine, x, y):
    """Gradients of the sum of the engine's training losses, as the pack's step takes them."""
    status = ops.convert_to_tensor(np.full((3,), ACTIVE, "int32"))
    variables = engine.fused.trainable_variables
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            losses, _ = engine.loss(x, y, engine.call(x, training=True), None, status, True)
            total = ops.sum(losses)
        return tape.gradient(total, [v.value for v in variables])
    losses, _ = engine.loss(x, y, engine.call(x, training=True), None, status, True)
    ops.sum(losses).backward()
    return [v.value.grad for v in variables]


@pytest.mark.skipif(
    keras.backend.backend() == "jax", reason="JAX differentiates a stateless call (the pack's)"
)
def test_a_step_on_the_stacked_weights_is_each_members_own_step():
    engine, members = _engine()
    optimizer = VectorizedOptimizer([m.optimizer for m in members])
    x, y = _data()
    optimizer.apply(_gradients(engine, x, y), engine.fused.trainable_variables)
    _, references = _engine()
    for j, reference in enumerate(references):
        reference.train_on_batch(x, y)
        for got, want in zip(engine.get_member_weights(j), reference.get_weights()):
            np.testing.assert_allclose(got, want, atol=ATOL)
