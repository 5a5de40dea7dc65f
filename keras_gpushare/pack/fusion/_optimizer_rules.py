"""Per-family update rules of `VectorizedOptimizer`, written over stacked variables.

Each rule mirrors the update step of a Keras optimizer family, with every
hyperparameter a per-member tensor broadcast against the leading member axis, and
names the slot lists of the family's Keras optimizer so state can be copied across.
"""

import keras
from keras import ops


class _Rule:
    family = ""
    classes = ()
    hyperparameters = ()

    def hyper(self, optimizer):
        return {name: float(getattr(optimizer, name)) for name in self.hyperparameters}

    def slots(self, hypers):
        """The stacked slots needed, `{name: per-member initial values}`."""
        raise NotImplementedError

    def member_slots(self, optimizer):
        """`{slot name: list attribute of the member optimizer}` for this optimizer."""
        raise NotImplementedError

    def update(self, gradient, variable, slots, h, lr, step):
        """Return `(new_variable, {slot name: new value})`."""
        raise NotImplementedError


class _SGD(_Rule):
    family = "SGD"
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

    def update(self, gradient, variable, slots, h, lr, step):
        if "momentum" not in slots:
            return variable - gradient * lr, {}
        m = slots["momentum"] * h["momentum"] - gradient * lr
        nesterov_step = m * h["momentum"] - gradient * lr
        delta = ops.where(h["nesterov"] > 0, nesterov_step, m)
        return variable + delta, {"momentum": m}


class _Adam(_Rule):
    family = "Adam/AdamW"
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
        slots = {"momentum": optimizer._momentums, "velocity": optimizer._velocities}
        if optimizer.amsgrad:
            slots["velocity_hat"] = optimizer._velocity_hats
        return slots

    def update(self, gradient, variable, slots, h, lr, step):
        beta_1_power = ops.power(h["beta_1"], step)
        beta_2_power = ops.power(h["beta_2"], step)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m = slots["momentum"] + (gradient - slots["momentum"]) * h["one_minus_beta_1"]
        v = slots["velocity"] + (ops.square(gradient) - slots["velocity"]) * h["one_minus_beta_2"]
        new = {"momentum": m, "velocity": v}
        if "velocity_hat" in slots:
            v_hat = ops.maximum(slots["velocity_hat"], v)
            new["velocity_hat"] = v_hat
            v = ops.where(h["amsgrad"] > 0, v_hat, v)
        return variable - (m * alpha) / (ops.sqrt(v) + h["epsilon"]), new


class _RMSprop(_Rule):
    family = "RMSprop"
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
        slots = {"velocity": optimizer._velocities}
        if optimizer.momentum > 0:
            slots["momentum"] = optimizer._momentums
        if optimizer.centered:
            slots["average_gradient"] = optimizer._average_gradients
        return slots

    def update(self, gradient, variable, slots, h, lr, step):
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


class _Adagrad(_Rule):
    family = "Adagrad"
    classes = (keras.optimizers.Adagrad,)
    hyperparameters = ("initial_accumulator_value", "epsilon")

    def slots(self, hypers):
        return {"accumulator": [h["initial_accumulator_value"] for h in hypers]}

    def member_slots(self, optimizer):
        return {"accumulator": optimizer._accumulators}

    def update(self, gradient, variable, slots, h, lr, step):
        accumulator = slots["accumulator"] + ops.square(gradient)
        new_variable = variable - (lr * gradient) / ops.sqrt(accumulator + h["epsilon"])
        return new_variable, {"accumulator": accumulator}


RULES = (_SGD(), _Adam(), _RMSprop(), _Adagrad())


def rule_for(optimizer):
    """Return the rule whose family contains exactly this optimizer's class, or `None`."""
    for rule in RULES:
        if type(optimizer) in rule.classes:
            return rule
    return None


def supported_names():
    """A readable list of the supported optimizer classes."""
    return ", ".join(c.__name__ for rule in RULES for c in rule.classes)
