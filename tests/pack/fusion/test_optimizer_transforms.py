"""Each of `VectorizedOptimizer`'s transforms alone, against a reference computed per member.

The transforms act on gradients stacked on a member axis; the reference for member `j` is
its own slice, worked out with NumPy or with a plain Keras optimizer.
"""

import contextlib
import io
import re

import keras
import numpy as np
import pytest
from keras import ops

import keras_gpushare as kg
from keras_gpushare.pack.fusion import VectorizedOptimizer, _transforms
from keras_gpushare.pack.fusion._optimizer_rules import OptimizerRule, register_optimizer_rule

SHAPES = [(3, 4), (4,)]


def _stacked(seed, k=3, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(scale * rng.normal(size=(k, *shape))).astype("float32") for shape in SHAPES]


def _numpy(tensors):
    return [np.asarray(ops.convert_to_numpy(t)) for t in tensors]


def _start(grads):
    return _transforms.GradientStep([ops.convert_to_tensor(g) for g in grads])


def _gated(grads, mask=(True, True, True), skip=True, scaled=(False, False, False)):
    gate = _transforms.apply_if_finite(ops.convert_to_tensor(np.asarray(mask)), skip, scaled)
    return gate(_start(grads))


def test_chain_applies_the_transforms_in_order():
    grads = _stacked(0)
    divisor = ops.convert_to_tensor(np.asarray([1.0, 2.0, 4.0], "float32"))
    step = _transforms.chain(
        _transforms.unscale(divisor), _transforms.clip([None] * 3, [None] * 3, [0.2] * 3)
    )(_start(grads))
    for g, out in zip(grads, _numpy(step.grads)):
        expected = np.clip(
            g / np.asarray([1.0, 2.0, 4.0]).reshape((3,) + (1,) * (g.ndim - 1)), -0.2, 0.2
        )
        np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_unscale_divides_each_member_by_its_scale():
    grads = _stacked(1)
    scales = np.asarray([2.0, 0.5, 8.0], "float32")
    step = _transforms.unscale(ops.convert_to_tensor(scales))(_start(grads))
    for g, out in zip(grads, _numpy(step.grads)):
        for j in range(3):
            np.testing.assert_allclose(out[j], g[j] / scales[j], rtol=1e-6)
    assert _transforms.unscale(None)(_start(grads)).grads[0] is not None


def test_apply_if_finite_gates_non_finite_and_masked_members():
    grads = _stacked(2)
    grads[1][2, 0] = np.nan
    step = _gated(grads, mask=(True, False, True))
    np.testing.assert_array_equal(_numpy([step.finite])[0], [True, True, False])
    np.testing.assert_array_equal(_numpy([step.active])[0], [True, False, False])
    np.testing.assert_array_equal(_numpy([step.updated])[0], [True, False, False])


def _compiled(function):
    """`function` compiled as a training step is (XLA on JAX and TensorFlow; torch eager),
    so the compiler's simplifications apply to it."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(function)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(function, jit_compile=True)
    return function


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("joined_at_most", [128, 6, 0])
def test_apply_if_finite_checks_each_member_across_gradients_of_several_dtypes(
    joined_at_most, compiled, monkeypatch
):
    # However many gradients one check joins (all, some, none).
    monkeypatch.setattr(_transforms, "_JOINED_AT_MOST", joined_at_most)
    rng = np.random.default_rng(6)
    grads = [
        rng.normal(size=(4, 3, 2)).astype("float16"),
        rng.normal(size=(4, 5)).astype("float32"),
        rng.normal(size=(4,)).astype("float16"),
    ]
    grads[0][0, 2, 1] = np.finfo("float16").max  # finite, the largest there is
    grads[1][0, 4] = np.finfo("float32").max
    grads[0][1, 1, 0] = np.inf
    grads[1][2, 0] = np.nan
    grads[2][3] = -np.inf
    gate = _transforms.apply_if_finite(ops.ones((4,), "bool"), True, (False,) * 4)

    def finite(*tensors):
        return gate(_transforms.GradientStep(list(tensors))).finite

    check = _compiled(finite) if compiled else finite
    expected = [all(np.isfinite(g[j]).all() for g in grads) for j in range(4)]
    assert expected == [True, False, False, False]
    found = check(*[ops.convert_to_tensor(g) for g in grads])
    np.testing.assert_array_equal(_numpy([found])[0], expected)


def test_apply_if_finite_off_applies_steps_except_for_loss_scaled_members():
    grads = _stacked(3)
    grads[0][0, 0] = np.inf
    grads[0][1, 0] = np.nan
    unchecked = _gated(grads, skip=False)
    np.testing.assert_array_equal(_numpy([unchecked.active])[0], [True, True, True])
    scaled = _gated(grads, skip=False, scaled=(False, True, False))
    np.testing.assert_array_equal(_numpy([scaled.finite])[0], [False, False, True])
    np.testing.assert_array_equal(_numpy([scaled.active])[0], [True, False, True])


def test_the_gate_and_keep_unchanged_leave_a_nan_member_as_it_was():
    values = _stacked(4)
    grads = _stacked(5)
    grads[0][1, 2, 3] = np.nan
    step = _gated(grads)
    variables = [keras.Variable(v) for v in values]
    kept = [
        (variable, ops.convert_to_tensor(v) - g, ops.convert_to_tensor(v), (0, 3))
        for variable, v, g in zip(variables, values, step.grads)
    ]
    for variable, value in _transforms.keep_unchanged(kept, step.updated):
        variable.assign(value)
    for variable, v, g in zip(variables, values, grads):
        new = np.asarray(ops.convert_to_numpy(variable))
        np.testing.assert_array_equal(new[1], v[1])
        np.testing.assert_allclose(new[[0, 2]], v[[0, 2]] - g[[0, 2]], rtol=1e-6)


def test_keep_unchanged_takes_each_runs_members_for_its_slots():
    new = ops.convert_to_tensor(np.ones((2, 3), "float32"))
    old = ops.convert_to_tensor(np.zeros((2, 3), "float32"))
    slot = keras.Variable(np.zeros((2, 3), "float32"))
    updated = ops.convert_to_tensor(np.asarray([True, True, False]))
    ((_, value),) = _transforms.keep_unchanged([(slot, new, old, (1, 3))], updated)
    np.testing.assert_array_equal(ops.convert_to_numpy(value), [[1, 1, 1], [0, 0, 0]])


def test_multi_steps_takes_the_mean_of_the_accumulated_steps():
    periods = [3, 1, 2]
    accumulators = [keras.Variable(np.zeros((3, *shape), "float32")) for shape in SHAPES]
    iterations = np.zeros(3, "int32")
    seen = []
    for t in range(6):
        grads = _stacked(10 + t)
        seen.append(grads)
        transform = _transforms.multi_steps(
            periods, ops.convert_to_tensor(iterations), accumulators
        )
        step = transform(_gated(grads))
        for variable, value in step.updates:
            variable.assign(value)
        updated = _numpy([step.updated])[0]
        for j, period in enumerate(periods):
            assert updated[j] == ((t + 1) % period == 0)
            if not updated[j]:
                continue
            for v, out in enumerate(_numpy(step.grads)):
                mean = sum(s[v][j] for s in seen[t + 1 - period :]) / period
                np.testing.assert_allclose(out[j], mean, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(ops.convert_to_numpy(accumulators[v])[j], 0.0)
        iterations += 1


def test_multi_steps_does_not_accumulate_inactive_members():
    accumulators = [keras.Variable(np.zeros((3, *shape), "float32")) for shape in SHAPES]
    grads = _stacked(20)
    grads[1][0, 0] = np.nan  # member 0's gradients are not finite, member 2 is masked
    step = _transforms.multi_steps([2, 2, 2], ops.zeros((3,), "int32"), accumulators)(
        _gated(grads, mask=(True, True, False))
    )
    for (_, value), g in zip(step.updates, grads):
        value = np.asarray(ops.convert_to_numpy(value))
        np.testing.assert_allclose(value[1], g[1], rtol=1e-6)
        np.testing.assert_array_equal(value[[0, 2]], 0.0)


@pytest.mark.parametrize(
    "option, limits",
    [
        ("clipnorm", [0.5, None, 2.0]),
        ("global_clipnorm", [None, 0.3, 1.5]),
        ("clipvalue", [0.1, 0.05, None]),
    ],
)
def test_clip_equals_each_members_keras_clipping(option, limits):
    grads = _stacked(30, scale=2.0)
    settings = {name: [None] * 3 for name in ("clipnorm", "global_clipnorm", "clipvalue")}
    settings[option] = limits
    step = _transforms.clip(**settings)(_start(grads))
    for j, limit in enumerate(limits):
        # SGD with a rate of 1 moves a zero variable by minus its clipped gradient.
        variables = [keras.Variable(np.zeros(shape, "float32")) for shape in SHAPES]
        # Tensors, as a training step gives it (Keras's torch SGD takes no NumPy arrays).
        keras.optimizers.SGD(1.0, **({option: limit} if limit else {})).apply(
            [ops.convert_to_tensor(g[j]) for g in grads], variables
        )
        for out, variable in zip(_numpy(step.grads), variables):
            np.testing.assert_allclose(out[j], -ops.convert_to_numpy(variable), rtol=1e-5)


def test_member_hyperparameters_are_per_member_data():
    hypers = [{"beta_1": 0.9}, {"beta_1": 0.8}, {"beta_1": 0.7}]

    class Rule(OptimizerRule):
        def step_terms(self, h, lr, step):
            return {"scaled": lr * step}

    rule, other = Rule(), Rule()
    hyper = _transforms.MemberHyperparameters(
        [(rule, 0, 1), (other, 1, 3)],
        hypers,
        ops.convert_to_tensor(np.asarray([0.1, 0.2, 0.3], "float32")),
        ops.convert_to_tensor(np.asarray([1.0, 2.0, 3.0], "float32")),
        [None, 0.5, None],
    )
    run = hyper.for_run(1, 3, "float32")
    assert run is hyper.for_run(1, 3, "float32")
    assert tuple(run["lr"].shape) == (2, 1, 1)
    np.testing.assert_allclose(np.ravel(run["hyper"]["beta_1"]), [0.8, 0.7])
    np.testing.assert_allclose(np.ravel(run["hyper"]["scaled"]), [0.4, 0.9], rtol=1e-6)
    np.testing.assert_allclose(np.ravel(hyper.weight_decay(2, "float32")), [0.0, 0.5, 0.0])


def test_decay_decays_each_member_at_its_rate():
    (value,) = _stacked(40)[:1]
    rates = np.asarray([0.1, 0.2, 0.3], "float32")
    hyper = _transforms.MemberHyperparameters(
        [(OptimizerRule(), 0, 3)], [{}] * 3, ops.convert_to_tensor(rates), None, [0.01, None, 0.5]
    )
    out = ops.convert_to_numpy(_transforms.decay(ops.convert_to_tensor(value), hyper))
    for j, wd in enumerate([0.01, 0.0, 0.5]):
        np.testing.assert_allclose(out[j], value[j] - value[j] * wd * rates[j], rtol=1e-6)
    nothing = _transforms.MemberHyperparameters([], [{}] * 3, None, None, [None] * 3)
    assert _transforms.decay(value, nothing) is value


def test_advance_rule_states_advances_the_groups_members_only():
    optimizers = [keras.optimizers.Nadam(beta_1=b) for b in (0.9, 0.8, 0.7)]
    vectorized = VectorizedOptimizer(optimizers)
    settings = [vectorized.member_settings(i) for i in range(3)]
    rule = settings[0].rule
    ids = np.asarray([2, 0], "int32")
    hyper = _transforms.MemberHyperparameters(
        [(rule, 0, 2)],
        [settings[i].hyper for i in ids],
        None,
        ops.convert_to_tensor(np.asarray([1.0, 4.0], "float32")),
        [None, None],
    )
    states = {"u_product": ops.convert_to_tensor(np.asarray([1.0, 0.5, 0.25], "float32"))}
    _, advanced = _transforms.advance_rule_states(
        hyper, states, ids, lambda v: ops.take(v, ids, axis=0)
    )
    expected = [0.25 * 0.7 * (1 - 0.5 * 0.96**1), 1.0 * 0.9 * (1 - 0.5 * 0.96**4)]
    np.testing.assert_allclose(ops.convert_to_numpy(advanced["u_product"]), expected, rtol=1e-6)


class SignMomentum(keras.optimizers.Optimizer):
    """A toy optimizer: a step of `learning_rate` along the sign of a momentum."""

    def __init__(self, learning_rate=0.01, beta=0.9, **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta = beta

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.momentums = [self.add_variable_from_reference(v, "momentum") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        m = self.momentums[self._get_variable_index(variable)]
        self.assign(m, m * ops.cast(self.beta, variable.dtype) + gradient)
        self.assign_sub(variable, ops.cast(learning_rate, variable.dtype) * ops.sign(m))

    def get_config(self):
        return {**super().get_config(), "beta": self.beta}


@register_optimizer_rule(SignMomentum)
class SignMomentumRule(OptimizerRule):
    hyperparameters = ("beta",)

    def slots(self, hypers):
        return {"momentum": [0.0] * len(hypers)}

    def member_slots(self, optimizer):
        return {"momentum": optimizer.momentums}

    def update(self, gradient, variable, slots, h, lr, step, state):
        m = slots["momentum"] * h["beta"] + gradient
        return variable - lr * ops.sign(m), {"momentum": m}


def _toy_mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((10,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )


def test_a_registered_rule_trains_fused_members_as_their_own_optimizers():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 10)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    settings = [(0.01, 0.9), (0.003, 0.5), (0.02, 0.0)]
    members = [_toy_mlp(seed) for seed in range(3)]
    twins = [_toy_mlp(seed) for seed in range(3)]
    pack = kg.ModelPack(members)
    assert pack.engine == "fused"
    pack.compile(optimizer=[SignMomentum(lr, beta) for lr, beta in settings], loss="mse")
    pack.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for (lr, beta), twin in zip(settings, twins):
        twin.compile(optimizer=SignMomentum(lr, beta), loss="mse")
        twin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for member, twin in zip(pack.members, twins):
        for a, b in zip(member.get_weights(), twin.get_weights()):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
        for a, b in zip(member.optimizer.momentums, twin.optimizer.momentums):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def test_register_optimizer_rule_checks_its_arguments():
    with pytest.raises(ValueError, match="expected a subclass of `keras.optimizers.Optimizer`"):
        register_optimizer_rule(SignMomentumRule)
    with pytest.raises(ValueError, match="expected a subclass of `OptimizerRule`"):
        register_optimizer_rule(SignMomentum)(object)


def test_register_optimizer_rule_docstring_example_prints_its_comment():
    code = re.search(r"```python\n(.*?)```", register_optimizer_rule.__doc__, re.S).group(1)
    code = "\n".join(line[4:] for line in code.splitlines())
    expected = [c.strip() for c in re.findall(r"print\(.*\)\s*# (.*)$", code, re.M)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "register_optimizer_rule", "exec"), {})
    assert printed.getvalue().split("\n")[: len(expected)] == expected


def _apply(optimizer, grads, variables):
    """`optimizer.apply`; on JAX its stateless form, as a training step runs it."""
    if keras.backend.backend() != "jax":
        optimizer.apply(grads, variables)
        return
    values, optimizer_values = optimizer.stateless_apply(
        [x.value for x in optimizer.variables], grads, [x.value for x in variables]
    )
    for variable, value in zip(optimizer.variables + variables, optimizer_values + values):
        variable.assign(value)


def test_dynamic_loss_scale_follows_keras_loss_scale_optimizers():
    settings = [(8.0, 2), (4.0, 3)]
    finite_steps = [[True, True], [True, False], [True, True], [False, True], [True, True]]
    own = [
        keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=scale, dynamic_growth_steps=growth
        )
        for scale, growth in settings
    ]
    variables = [[keras.Variable(np.zeros(2, "float32"))] for _ in own]
    for optimizer, v in zip(own, variables):
        optimizer.build(v)
    scale = ops.convert_to_tensor(np.asarray([8.0, 4.0, 1.0], "float32"))
    counter = ops.zeros((3,), "int32")
    trained = ops.convert_to_tensor(np.asarray([True, True, False]))
    for finite in finite_steps:
        for ok, optimizer, v in zip(finite, own, variables):
            _apply(optimizer, [np.full(2, 1.0 if ok else np.inf, "float32")], v)
        flags = ops.convert_to_tensor(np.asarray([*finite, False]))
        scale, counter = _transforms.dynamic_loss_scale(scale, counter, flags, [2, 3, 1], trained)
        expected_scale = [float(ops.convert_to_numpy(o.dynamic_scale)) for o in own]
        expected_counter = [int(ops.convert_to_numpy(o.step_counter)) for o in own]
        np.testing.assert_array_equal(ops.convert_to_numpy(scale), [*expected_scale, 1.0])
        np.testing.assert_array_equal(ops.convert_to_numpy(counter), [*expected_counter, 0])
    lost = ops.convert_to_tensor(np.asarray([np.nan, 1.0, 1.0], "float32"))
    kept, _ = _transforms.dynamic_loss_scale(
        scale, counter, ops.ones((3,), "bool"), [2, 3, 1], trained, lost
    )
    np.testing.assert_array_equal(ops.convert_to_numpy(kept)[0], ops.convert_to_numpy(scale)[0])
