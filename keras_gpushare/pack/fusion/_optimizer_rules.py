"""Per-class update rules of `VectorizedOptimizer`, written over stacked variables.

Each rule mirrors the update step of a Keras optimizer class, with every hyperparameter a
per-member tensor broadcast against the leading member axis, and names the slot lists (and
per-member scalar state) of the class's Keras optimizer so state can be copied across. The
operations follow Keras's own `update_step` in the same order, so a member's slice is updated
to the value its own optimizer would compute. `register_optimizer_rule` adds a rule for an
optimizer class of one's own.
"""

from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from keras_gpushare import _upstream


class OptimizerRule:
    """An optimizer's update, written over variables stacked on a member axis.

    A rule mirrors one optimizer class's `update_step` for `k` members at once: each of
    its tensors has the members on its first axis, and each hyperparameter is a per-member
    tensor shaped to broadcast against them (`(m, 1, ...)`), so members with different
    settings share one update. `VectorizedOptimizer` applies it after its own gradient
    transforms (unscaling, finiteness, accumulation, clipping) and weight decay, and keeps
    the old values of members that take no step. Register one for an optimizer class with
    `register_optimizer_rule`.

    Attributes:
        hyperparameters: the optimizer attributes read as floats, one per member, into the
            `h` of `update`.
        member_state: `{name: function of the optimizer returning a scalar variable}`:
            per-member scalar state kept beside the slots (Nadam's `u_product`).
        linear_in_gradient: whether the update is linear in the gradient, so that applying
            it to a sum of sparse slices equals summing its applications (SGD, Lion): on
            TensorFlow, Keras updates an `Embedding` from such slices.
    """

    classes: tuple[type, ...] = ()
    hyperparameters: tuple[str, ...] = ()
    member_state: dict[str, Callable[[Any], Any]] = {}
    linear_in_gradient = False

    def hyper(self, optimizer):
        """`{name: float}`: `optimizer`'s hyperparameters, read once."""
        return {name: float(getattr(optimizer, name)) for name in self.hyperparameters}

    def slots(self, hypers):
        """The stacked slots needed, `{name: per-member initial values}`."""
        raise NotImplementedError

    def member_slots(self, optimizer):
        """`{slot name: list of optimizer's slot variables, in its variable order}`."""
        raise NotImplementedError

    def initial_state(self, hypers):
        """`{state name: per-member initial values}` of the per-member scalar state."""
        return {}

    def advance(self, state, h, step):
        """The per-member state for this step (called once a step, before the updates)."""
        return state

    def step_terms(self, h, lr, step):
        """Terms of this step shared by every variable, `{name: tensor}`, passed in `h`.

        Computed once per step and variable shape, with the operations Keras computes
        per variable, so the values are the same.
        """
        return {}

    def update(self, gradient, variable, slots, h, lr, step, state):
        """Return `(new_variable, {slot name: new value})`."""
        raise NotImplementedError


class _SGD(OptimizerRule):
    linear_in_gradient = True
    classes = (keras.optimizers.SGD,)
    hyperparameters = ("momentum",)

    def hyper(self, optimizer):
        values = super().hyper(optimizer)
        values["nesterov"] = float(bool(optimizer.nesterov))
        return values

    def slots(self, hypers):
        if any(h["momentum"] != 0 for h in hypers):
            return {"momentum": [0.0] * len(hypers)}
        return {}

    def member_slots(self, optimizer):
        return {"momentum": optimizer.momentums} if optimizer.momentum != 0 else {}

    def update(self, gradient, variable, slots, h, lr, step, state):
        if "momentum" not in slots:
            return variable - gradient * lr, {}
        m = slots["momentum"] * h["momentum"] - gradient * lr
        nesterov_step = m * h["momentum"] - gradient * lr
        delta = ops.where(h["nesterov"] > 0, nesterov_step, m)
        return variable + delta, {"momentum": m}


class _Adam(OptimizerRule):
    classes = (keras.optimizers.Adam, keras.optimizers.AdamW)
    hyperparameters = ("beta_1", "beta_2", "epsilon")

    def hyper(self, optimizer):
        values = super().hyper(optimizer)
        values["one_minus_beta_1"] = 1 - optimizer.beta_1
        values["one_minus_beta_2"] = 1 - optimizer.beta_2
        values["amsgrad"] = float(bool(optimizer.amsgrad))
        return values

    def slots(self, hypers):
        names = ["momentum", "velocity"]
        if any(h["amsgrad"] for h in hypers):
            names.append("velocity_hat")
        return {name: [0.0] * len(hypers) for name in names}

    def member_slots(self, optimizer):
        slots = {
            "momentum": _upstream.slot_list(optimizer, "momentums"),
            "velocity": _upstream.slot_list(optimizer, "velocities"),
        }
        if optimizer.amsgrad:
            slots["velocity_hat"] = _upstream.slot_list(optimizer, "velocity_hats")
        return slots

    def step_terms(self, h, lr, step):
        beta_1_power = ops.power(h["beta_1"], step)
        beta_2_power = ops.power(h["beta_2"], step)
        return {"alpha": lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)}

    def update(self, gradient, variable, slots, h, lr, step, state):
        alpha = h["alpha"]
        m = slots["momentum"] + (gradient - slots["momentum"]) * h["one_minus_beta_1"]
        v = slots["velocity"] + (ops.square(gradient) - slots["velocity"]) * h["one_minus_beta_2"]
        new = {"momentum": m, "velocity": v}
        if "velocity_hat" in slots:
            v_hat = ops.maximum(slots["velocity_hat"], v)
            new["velocity_hat"] = v_hat
            v = ops.where(h["amsgrad"] > 0, v_hat, v)
        return variable - (m * alpha) / (ops.sqrt(v) + h["epsilon"]), new


class _Adamax(OptimizerRule):
    classes = (keras.optimizers.Adamax,)
    hyperparameters = ("beta_1", "beta_2", "epsilon")

    def slots(self, hypers):
        return {"momentum": [0.0] * len(hypers), "norm": [0.0] * len(hypers)}

    def member_slots(self, optimizer):
        return {
            "momentum": _upstream.slot_list(optimizer, "m"),
            "norm": _upstream.slot_list(optimizer, "u"),
        }

    def update(self, gradient, variable, slots, h, lr, step, state):
        beta_1_power = ops.power(h["beta_1"], step)
        m = slots["momentum"] + (gradient - slots["momentum"]) * (1 - h["beta_1"])
        u = ops.maximum(h["beta_2"] * slots["norm"], ops.abs(gradient))
        new_variable = variable - (lr * m) / ((1 - beta_1_power) * (u + h["epsilon"]))
        return new_variable, {"momentum": m, "norm": u}


class _Nadam(OptimizerRule):
    classes = (keras.optimizers.Nadam,)
    hyperparameters = ("beta_1", "beta_2", "epsilon")
    member_state = {"u_product": _upstream.nadam_u_product}

    def slots(self, hypers):
        return {"momentum": [0.0] * len(hypers), "velocity": [0.0] * len(hypers)}

    def member_slots(self, optimizer):
        return {
            "momentum": _upstream.slot_list(optimizer, "momentums"),
            "velocity": _upstream.slot_list(optimizer, "velocities"),
        }

    def initial_state(self, hypers):
        return {"u_product": [1.0] * len(hypers)}

    def advance(self, state, h, step):
        # Keras multiplies its `_u_product` once per step, before the variables' updates.
        factor = h["beta_1"] * (1.0 - 0.5 * ops.power(0.96, step))
        return {"u_product": state["u_product"] * factor}

    def update(self, gradient, variable, slots, h, lr, step, state):
        decay = 0.96
        u_t = h["beta_1"] * (1.0 - 0.5 * ops.power(decay, step))
        u_t_1 = h["beta_1"] * (1.0 - 0.5 * ops.power(decay, step + 1))
        u_product_t = state["u_product"]
        u_product_t_1 = u_product_t * u_t_1
        beta_2_power = ops.power(h["beta_2"], step)
        m = slots["momentum"] + (gradient - slots["momentum"]) * (1 - h["beta_1"])
        v = slots["velocity"] + (ops.square(gradient) - slots["velocity"]) * (1 - h["beta_2"])
        m_hat = (u_t_1 * m) / (1 - u_product_t_1) + ((1 - u_t) * gradient) / (1 - u_product_t)
        v_hat = v / (1 - beta_2_power)
        new_variable = variable - (m_hat * lr) / (ops.sqrt(v_hat) + h["epsilon"])
        return new_variable, {"momentum": m, "velocity": v}


class _Lion(OptimizerRule):
    linear_in_gradient = True
    classes = (keras.optimizers.Lion,)
    hyperparameters = ("beta_1", "beta_2")

    def slots(self, hypers):
        return {"momentum": [0.0] * len(hypers)}

    def member_slots(self, optimizer):
        return {"momentum": _upstream.slot_list(optimizer, "momentums")}

    def update(self, gradient, variable, slots, h, lr, step, state):
        m = slots["momentum"]
        direction = ops.sign(m * h["beta_1"] + gradient * (1.0 - h["beta_1"]))
        new_m = m * h["beta_2"] + gradient * (1.0 - h["beta_2"])
        return variable - lr * direction, {"momentum": new_m}


class _Lamb(OptimizerRule):
    classes = (keras.optimizers.Lamb,)
    hyperparameters = ("beta_1", "beta_2", "epsilon")

    def slots(self, hypers):
        return {"momentum": [0.0] * len(hypers), "velocity": [0.0] * len(hypers)}

    def member_slots(self, optimizer):
        return {
            "momentum": _upstream.slot_list(optimizer, "momentums"),
            "velocity": _upstream.slot_list(optimizer, "velocities"),
        }

    def update(self, gradient, variable, slots, h, lr, step, state):
        beta_1_power = ops.power(h["beta_1"], step)
        beta_2_power = ops.power(h["beta_2"], step)
        m = slots["momentum"] + (gradient - slots["momentum"]) * (1 - h["beta_1"])
        v = slots["velocity"] + (ops.square(gradient) - slots["velocity"]) * (1 - h["beta_2"])
        m_t_hat = m / (1.0 - beta_1_power)
        v_sqrt = ops.sqrt(v / (1.0 - beta_2_power)) + h["epsilon"]
        update = m_t_hat / v_sqrt
        axes = tuple(range(1, len(variable.shape)))
        w_norm = ops.sqrt(ops.sum(ops.power(variable, 2), axis=axes, keepdims=True))
        g_norm = ops.sqrt(ops.sum(ops.power(update, 2), axis=axes, keepdims=True))
        safe = ops.where(g_norm > 0, g_norm, ops.ones_like(g_norm))
        ratio = ops.where(w_norm > 0, ops.where(g_norm > 0, w_norm / safe, 1.0), 1.0)
        return variable - ratio * lr * update, {"momentum": m, "velocity": v}


class _RMSprop(OptimizerRule):
    classes = (keras.optimizers.RMSprop,)
    hyperparameters = ("rho", "momentum", "epsilon")

    def hyper(self, optimizer):
        values = super().hyper(optimizer)
        values["one_minus_rho"] = 1 - optimizer.rho
        values["centered"] = float(bool(optimizer.centered))
        return values

    def slots(self, hypers):
        names = ["velocity"]
        if any(h["momentum"] > 0 for h in hypers):
            names.append("momentum")
        if any(h["centered"] for h in hypers):
            names.append("average_gradient")
        return {name: [0.0] * len(hypers) for name in names}

    def member_slots(self, optimizer):
        slots = {"velocity": _upstream.slot_list(optimizer, "velocities")}
        if optimizer.momentum > 0:
            slots["momentum"] = _upstream.slot_list(optimizer, "momentums")
        if optimizer.centered:
            slots["average_gradient"] = _upstream.slot_list(optimizer, "average_gradients")
        return slots

    def update(self, gradient, variable, slots, h, lr, step, state):
        velocity = h["rho"] * slots["velocity"] + h["one_minus_rho"] * ops.square(gradient)
        new = {"velocity": velocity}
        denominator = velocity + h["epsilon"]
        if "average_gradient" in slots:
            average = h["rho"] * slots["average_gradient"] + h["one_minus_rho"] * gradient
            new["average_gradient"] = average
            centered = velocity - ops.square(average) + h["epsilon"]
            denominator = ops.where(h["centered"] > 0, centered, denominator)
        increment = (lr * gradient) / ops.sqrt(denominator)
        if "momentum" in slots:
            increment = h["momentum"] * slots["momentum"] + increment
            new["momentum"] = increment
        return variable - increment, new


class _Adagrad(OptimizerRule):
    classes = (keras.optimizers.Adagrad,)
    hyperparameters = ("initial_accumulator_value", "epsilon")

    def slots(self, hypers):
        return {"accumulator": [h["initial_accumulator_value"] for h in hypers]}

    def member_slots(self, optimizer):
        return {"accumulator": _upstream.slot_list(optimizer, "accumulators")}

    def update(self, gradient, variable, slots, h, lr, step, state):
        accumulator = slots["accumulator"] + ops.square(gradient)
        new_variable = variable - (lr * gradient) / ops.sqrt(accumulator + h["epsilon"])
        return new_variable, {"accumulator": accumulator}


class _Adadelta(OptimizerRule):
    classes = (keras.optimizers.Adadelta,)
    hyperparameters = ("rho", "epsilon")

    def slots(self, hypers):
        zeros = [0.0] * len(hypers)
        return {"accumulated_grad": zeros, "accumulated_delta_var": list(zeros)}

    def member_slots(self, optimizer):
        return {
            "accumulated_grad": _upstream.slot_list(optimizer, "accumulated_grads"),
            "accumulated_delta_var": _upstream.slot_list(optimizer, "accumulated_delta_vars"),
        }

    def update(self, gradient, variable, slots, h, lr, step, state):
        rho = h["rho"]

        def rms(x):
            return ops.sqrt(x + h["epsilon"])

        accumulated_grad = rho * slots["accumulated_grad"] + (1 - rho) * ops.square(gradient)
        delta = -(rms(slots["accumulated_delta_var"]) * gradient) / rms(accumulated_grad)
        accumulated_delta = rho * slots["accumulated_delta_var"] + (1 - rho) * ops.square(delta)
        new = {"accumulated_grad": accumulated_grad, "accumulated_delta_var": accumulated_delta}
        return variable + lr * delta, new


class _Ftrl(OptimizerRule):
    classes = (keras.optimizers.Ftrl,)
    hyperparameters = (
        "learning_rate_power",
        "l1_regularization_strength",
        "l2_regularization_strength",
        "l2_shrinkage_regularization_strength",
        "beta",
        "initial_accumulator_value",
    )

    def slots(self, hypers):
        return {
            "accumulator": [h["initial_accumulator_value"] for h in hypers],
            "linear": [0.0] * len(hypers),
        }

    def member_slots(self, optimizer):
        return {
            "accumulator": _upstream.slot_list(optimizer, "accumulators"),
            "linear": _upstream.slot_list(optimizer, "linears"),
        }

    def update(self, gradient, variable, slots, h, lr, step, state):
        accum, linear = slots["accumulator"], slots["linear"]
        power = -h["learning_rate_power"]
        l2 = h["l2_regularization_strength"] + h["beta"] / (2.0 * lr)
        grad_to_use = gradient + 2 * h["l2_shrinkage_regularization_strength"] * variable
        new_accum = accum + ops.square(gradient)
        linear = linear + (
            grad_to_use - ((ops.power(new_accum, power) - ops.power(accum, power)) / lr) * variable
        )
        quadratic = ops.power(new_accum, power) / lr + 2 * l2
        l1 = h["l1_regularization_strength"]
        linear_clipped = ops.clip(linear, -l1, l1)
        new_variable = (linear_clipped - linear) / quadratic
        return new_variable, {"accumulator": new_accum, "linear": linear}


_BY_CLASS: dict[type, OptimizerRule] = {
    cls: rule
    for rule in (
        _SGD(),
        _Adam(),
        _Adamax(),
        _Nadam(),
        _Lion(),
        _Lamb(),
        _RMSprop(),
        _Adagrad(),
        _Adadelta(),
        _Ftrl(),
    )
    for cls in rule.classes
}


def register_optimizer_rule(optimizer_class: type) -> Callable[[type], type]:
    """Register the vectorized update of an optimizer class, for use as a class decorator.

    The rule class subclasses `OptimizerRule` and mirrors the optimizer's `update_step` on
    tensors stacked on a member axis (see `OptimizerRule`); the fused engine then trains
    members compiled with that optimizer together, each slice as its own optimizer would
    update it, with the learning rate, schedules, weight decay, clipping, loss scaling and
    gradient accumulation of Keras's base optimizer applied around the rule. Registration
    is by exact class: a subclass of a registered optimizer needs its own rule.

    Args:
        optimizer_class: The Keras optimizer class (not an instance) whose rule follows.

    Returns:
        A decorator taking the rule class and returning it unchanged.

    Example:

    ```python
    import keras
    from keras import ops
    import keras_gpushare as kg
    from keras_gpushare.pack.fusion import OptimizerRule, VectorizedOptimizer

    class SignSGD(keras.optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign_sub(ops.sign(gradient) * ops.cast(learning_rate, variable.dtype))

    @kg.register_optimizer_rule(SignSGD)
    class SignSGDRule(OptimizerRule):
        def slots(self, hypers):
            return {}

        def member_slots(self, optimizer):
            return {}

        def update(self, gradient, variable, slots, h, lr, step, state):
            return variable - ops.sign(gradient) * lr, {}

    optimizer = VectorizedOptimizer([SignSGD(0.1), SignSGD(0.01)])
    w = keras.Variable(keras.ops.zeros((2, 3)))
    optimizer.apply([keras.ops.ones((2, 3))], [w])
    print(keras.ops.convert_to_numpy(w)[:, 0])  # [-0.1  -0.01]
    ```
    """
    if not (
        isinstance(optimizer_class, type)
        and issubclass(optimizer_class, keras.optimizers.Optimizer)
    ):
        raise ValueError(
            "Invalid value for argument `optimizer_class`: expected a subclass of "
            f"`keras.optimizers.Optimizer`, got {optimizer_class!r}. Pass the class itself, "
            "e.g. `@register_optimizer_rule(MyOptimizer)`."
        )

    def decorator(rule_class: type) -> type:
        if not (isinstance(rule_class, type) and issubclass(rule_class, OptimizerRule)):
            raise ValueError(
                f"Invalid rule for `{optimizer_class.__name__}`: expected a subclass of "
                f"`OptimizerRule`, got {rule_class!r}."
            )
        rule = rule_class()
        rule.classes = (*rule.classes, optimizer_class)
        _BY_CLASS[optimizer_class] = rule
        return rule_class

    return decorator


def keras_class(optimizer):
    """The public Keras optimizer class `optimizer` is, or `None` for a user's own subclass.

    Backends subclass Keras's optimizers (on torch, `keras.optimizers.Adam(...)` is a
    torch-specific `Adam`); those count as the public class. A class written outside Keras
    may change the update, so it has none.
    """
    for cls in type(optimizer).__mro__:
        if cls in _BY_CLASS or _upstream.is_keras_builtin(cls, "optimizers"):
            return cls
        if not _upstream.is_keras_builtin(cls, "backend"):
            return None
    return None


def rule_for(optimizer):
    """Return the rule for this optimizer's class, or `None` when it has no vectorized form."""
    return _BY_CLASS.get(keras_class(optimizer))


def supported_names():
    """A readable list of the supported optimizer classes."""
    return ", ".join(c.__name__ for c in _BY_CLASS)
