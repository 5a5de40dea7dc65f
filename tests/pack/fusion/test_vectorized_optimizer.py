"""VectorizedOptimizer gives each member's slice what that member's optimizer gives it."""

import keras
import numpy as np
import pytest
from fusion_models import mlp
from keras import ops
from keras.optimizers import (
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    Ftrl,
    Lamb,
    Lion,
    Nadam,
    RMSprop,
)
from keras.optimizers.schedules import ExponentialDecay, PiecewiseConstantDecay

from keras_gpushare.pack.fusion import VectorizedOptimizer, build_fused_model

SHAPES = [(3, 4), (4,)]
STEPS = 3

CASES = {
    "sgd": lambda: [SGD(0.1), SGD(0.05, momentum=0.9), SGD(0.02, momentum=0.8, nesterov=True)],
    "adam": lambda: [
        Adam(1e-2),
        Adam(5e-3, beta_1=0.8, beta_2=0.99, epsilon=1e-5, amsgrad=True),
        AdamW(1e-2, weight_decay=0.1),
    ],
    "rmsprop": lambda: [
        RMSprop(1e-2),
        RMSprop(1e-2, momentum=0.5),
        RMSprop(2e-2, rho=0.8, centered=True),
    ],
    "adagrad": lambda: [
        Adagrad(0.1),
        Adagrad(0.05, initial_accumulator_value=0.5),
        Adagrad(0.1, epsilon=1e-3),
    ],
    "clipping": lambda: [
        Adam(1e-2, clipnorm=0.5),
        Adam(1e-2, global_clipnorm=0.3),
        Adam(1e-2, clipvalue=0.1),
    ],
    "nadam_adamax_lion": lambda: [
        Nadam(1e-2),
        Adamax(2e-2, beta_1=0.8),
        Lion(1e-3, beta_1=0.8, beta_2=0.95),
    ],
    "lamb_adadelta_ftrl": lambda: [
        Lamb(1e-2),
        Adadelta(0.5, rho=0.9),
        Ftrl(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.1),
    ],
    "families_interleaved": lambda: [
        Adam(1e-2),
        SGD(0.05, momentum=0.9),
        Adam(3e-3, amsgrad=True),
    ],
    "accumulation_and_fixed_scale": lambda: [
        Adam(1e-2, gradient_accumulation_steps=2),
        SGD(0.1, loss_scale_factor=4.0),
        Nadam(1e-2, gradient_accumulation_steps=3),
    ],
    "schedules_and_decay": lambda: [
        SGD(ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5), momentum=0.5),
        SGD(0.05, weight_decay=0.01),
        SGD(PiecewiseConstantDecay([1], [0.1, 0.01])),
    ],
}


def _grads(seed, n=3):
    rng = np.random.default_rng(seed)
    return [ops.convert_to_tensor(rng.normal(size=(n, *shape)), "float32") for shape in SHAPES]


def _setup(optimizers):
    rng = np.random.default_rng(42)
    values = [rng.normal(size=(len(optimizers), *shape)).astype("float32") for shape in SHAPES]
    stacked = [keras.Variable(v) for v in values]
    members = [[keras.Variable(v[i]) for v in values] for i in range(len(optimizers))]
    return stacked, members


def _pairs(stacked, members):
    return [(s, tuple((m[k], None) for m in members)) for k, s in enumerate(stacked)]


def _assert_member(stacked, variables, i, atol=1e-6):
    for s, v in zip(stacked, variables):
        np.testing.assert_allclose(np.asarray(s)[i], np.asarray(v), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_match_member_optimizers(case):
    stacked, members = _setup(CASES[case]())
    vectorized = VectorizedOptimizer(CASES[case]())
    own = CASES[case]()
    for step in range(STEPS):
        grads = _grads(step)
        vectorized.apply(grads, stacked)
        for i, (optimizer, variables) in enumerate(zip(own, members)):
            optimizer.apply([g[i] for g in grads], variables)
    for i, variables in enumerate(members):
        _assert_member(stacked, variables, i)
    np.testing.assert_array_equal(np.asarray(vectorized.member_iterations), [STEPS] * 3)

    fresh = CASES[case]()
    vectorized.write_state_to(fresh, _pairs(stacked, members))
    for optimizer, reference in zip(fresh, own):
        assert int(np.asarray(optimizer.iterations)) == int(np.asarray(reference.iterations))
        for a, b in zip(optimizer.variables, reference.variables):
            if a.path.endswith("learning_rate"):
                continue
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_read_state_from_resumes_members():
    stacked, members = _setup(CASES["adam"]())
    own = CASES["adam"]()
    for step in range(2):
        for i, (optimizer, variables) in enumerate(zip(own, members)):
            optimizer.apply([g[i] for g in _grads(step)], variables)
    for k, s in enumerate(stacked):
        s.assign(np.stack([np.asarray(m[k]) for m in members]))
    vectorized = VectorizedOptimizer(CASES["adam"]())
    vectorized.build(stacked)
    vectorized.read_state_from(own, _pairs(stacked, members))
    vectorized.apply(_grads(7), stacked)
    for i, (optimizer, variables) in enumerate(zip(own, members)):
        optimizer.apply([g[i] for g in _grads(7)], variables)
        _assert_member(stacked, variables, i)


def test_masked_and_nonfinite_members_are_unchanged():
    stacked, members = _setup(CASES["adam"]())
    vectorized = VectorizedOptimizer(CASES["adam"]())
    vectorized.apply(_grads(0), stacked)
    before = [np.asarray(v).copy() for v in stacked + vectorized.variables]
    vectorized.member_mask.assign(np.asarray([1.0, 0.0, 1.0], "float32"))
    grads = [np.array(g) for g in _grads(1)]
    grads[1][2, 0] = np.nan
    vectorized.apply(grads, stacked)
    np.testing.assert_array_equal(np.asarray(vectorized.nonfinite), [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(np.asarray(vectorized.member_iterations), [2, 1, 1])
    after = [np.asarray(v) for v in stacked + vectorized.variables]
    for old, new, variable in zip(before, after, stacked + vectorized.variables):
        if (
            len(old.shape)
            and old.shape[0] == 3
            and variable.path.split("/")[-1]
            not in (
                "member_mask",
                "nonfinite",
                "member_iterations",
            )
        ):
            np.testing.assert_array_equal(new[1:], old[1:])
            assert np.all(np.isfinite(new))
            if any(variable is s for s in stacked):
                assert not np.array_equal(new[0], old[0])
    vectorized.member_mask.assign(np.ones(3, "float32"))
    vectorized.apply(_grads(2), stacked)
    np.testing.assert_array_equal(np.asarray(vectorized.nonfinite), [0.0, 0.0, 0.0])


def test_unsupported_optimizers_are_named():
    with pytest.raises(ValueError, match="Member 1's optimizer `Muon` has no vectorized"):
        VectorizedOptimizer([SGD(), keras.optimizers.Muon()])
    with pytest.raises(ValueError, match="Member 0's optimizer sets `use_ema=True`"):
        VectorizedOptimizer([Adam(use_ema=True)])

    class OwnAdam(Adam):
        pass

    with pytest.raises(ValueError, match="Member 0's optimizer `OwnAdam` has no vectorized"):
        VectorizedOptimizer([OwnAdam()])


def test_serialization_round_trip():
    # Through Keras's registry, as a saved file's optimizer is read back.
    vectorized = VectorizedOptimizer(CASES["schedules_and_decay"]())
    config = keras.optimizers.serialize(vectorized)
    assert config["registered_name"] == "keras_gpushare>VectorizedOptimizer"
    restored = keras.optimizers.deserialize(config)
    assert isinstance(restored, VectorizedOptimizer)
    assert restored.n_members == 3
    assert isinstance(restored.member_schedule(0), ExponentialDecay)


def _train_members(members, x, y, steps):
    for member in members:
        optimizer = SGD(0.05, momentum=0.9)
        for _ in range(steps):
            grads = _member_grads(member, x, y)
            optimizer.apply(grads, member.trainable_variables)


def _member_grads(member, x, y):
    from fusion_models import gradients

    def loss():
        return ops.mean(ops.square(member(x) - y))

    return gradients(loss, member.trainable_variables)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="XLA step under TF")
def test_fused_training_step_under_xla_matches_members():
    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(32, 10)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")
    members = [mlp(seed) for seed in range(3)]
    fused = build_fused_model(members)
    optimizer = VectorizedOptimizer([SGD(0.05, momentum=0.9) for _ in range(3)])
    optimizer.build(fused.trainable_variables)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.reduce_mean(tf.square(fused(x) - y), axis=[1, 2]))
        grads = tape.gradient(loss, fused.trainable_variables)
        optimizer.apply(grads, fused.trainable_variables)

    for _ in range(3):
        step(x, y)
    _train_members(members, x, y, 3)
    copies = [mlp(seed) for seed in range(3)]
    fused.write_to_members(copies)
    for member, copy in zip(members, copies):
        for a, b in zip(member.weights, copy.weights):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="stateless apply under JAX")
def test_stateless_apply_under_jax():
    import jax

    stacked, members = _setup(CASES["adam"]())
    vectorized = VectorizedOptimizer(CASES["adam"]())
    vectorized.build(stacked)
    vectorized.member_mask.assign(np.asarray([1.0, 1.0, 0.0], "float32"))
    own = CASES["adam"]()
    grads = [np.array(g) for g in _grads(0)]
    grads[0][0, 0] = np.inf

    @jax.jit
    def apply(optimizer_values, grads, values):
        return vectorized.stateless_apply(optimizer_values, grads, values)

    values, optimizer_values = apply(
        [v.value for v in vectorized.variables], grads, [v.value for v in stacked]
    )
    new = dict(zip([v.path for v in vectorized.variables], optimizer_values))
    np.testing.assert_array_equal(np.asarray(new[vectorized.nonfinite.path]), [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(new[vectorized.member_iterations.path]), [0, 1, 0])
    own[1].apply([g[1] for g in grads], members[1])
    for value, variable in zip(values, members[1]):
        np.testing.assert_allclose(np.asarray(value)[1], np.asarray(variable), atol=1e-6)
    for value, variable in zip(values, stacked):
        np.testing.assert_array_equal(np.asarray(value)[[0, 2]], np.asarray(variable)[[0, 2]])
