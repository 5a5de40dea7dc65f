"""`VectorizedOptimizer`: N members' optimizers applied to stacked variables at once."""

import logging
from collections.abc import Sequence

import keras
import numpy as np
from keras import ops

from keras_gpushare.pack.fusion import _optimizer_rules

logger = logging.getLogger(__name__)

_CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


def _hyper_or_none(optimizer, name):
    value = getattr(optimizer, name, None)
    return None if value is None or value <= 0 else float(value)


def _check_member(i, optimizer, rule, family):
    supported = _optimizer_rules.supported_names()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"Invalid optimizer for member {i}: expected a `keras.optimizers.Optimizer`, got "
            f"{type(optimizer).__name__}. Pass one of: {supported}."
        )
    if rule is None:
        raise ValueError(
            f"Member {i}'s optimizer `{type(optimizer).__name__}` has no vectorized form. "
            f"Supported: {supported}; use one of them or the graph engine."
        )
    if rule.family != family:
        raise ValueError(
            f"Member {i}'s optimizer `{type(optimizer).__name__}` is of family "
            f"{rule.family}, member 0's of family {family}. A vectorized optimizer needs one "
            "family for all members; give them optimizers of one family."
        )
    options = {
        "use_ema": optimizer.use_ema,
        "gradient_accumulation_steps": optimizer.gradient_accumulation_steps,
        "loss_scale_factor": optimizer.loss_scale_factor,
        "exclude_from_weight_decay": getattr(optimizer, "_exclude_from_weight_decay", None)
        or getattr(optimizer, "_exclude_from_weight_decay_pattern", None),
    }
    for name, value in options.items():
        if value:
            raise ValueError(
                f"Member {i}'s optimizer sets `{name}={value!r}`, which the vectorized "
                f"optimizer does not support. Supported: {supported} with learning rates, "
                "schedules, their own hyperparameters, weight_decay, clipnorm, "
                "global_clipnorm and clipvalue."
            )
    learning_rate = optimizer._learning_rate
    schedule = keras.optimizers.schedules.LearningRateSchedule
    if callable(learning_rate) and not isinstance(learning_rate, schedule):
        raise ValueError(
            f"Member {i}'s optimizer has a callable learning rate that is not a "
            "`keras.optimizers.schedules.LearningRateSchedule`. Pass a float or a schedule."
        )


@keras.saving.register_keras_serializable(package="keras_gpushare")
class VectorizedOptimizer(keras.optimizers.Optimizer):
    """N members' optimizers applied at once to variables stacked on a member axis.

    Member i's slice of every stacked variable is updated exactly as member i's own
    optimizer would update its own variables: its learning rate (or schedule, evaluated
    at its own step count), its hyperparameters, weight decay and gradient clipping,
    each taken over its own slices only. The update is a handful of element-wise ops
    over the stacked variables, with no per-member loop.

    It also isolates members:

    - `member_mask` (optimizer variable, shape `(N,)`): 1.0 updates the member, 0.0
      freezes it; a frozen member's variables, slots and step count stay unchanged.
    - `nonfinite` (optimizer variable, shape `(N,)`): set at every step to 1.0 for each
      member whose gradients were not all finite; that member got no update that step.

    Both are optimizer variables, so they work inside `stateless_apply` on JAX too.
    Supported families: SGD (momentum, nesterov), Adam and AdamW (amsgrad), RMSprop
    (momentum, centered), Adagrad; all members must share a family.

    Args:
        optimizers: One Keras optimizer per member, not yet used or already built (their
            state is read with `read_state_from`). Defaults to none (required).
        name: Name of the optimizer. Defaults to `"vectorized_optimizer"`.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion import VectorizedOptimizer

    optimizer = VectorizedOptimizer(
        [keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-2, beta_1=0.8)]
    )
    w = keras.Variable(keras.ops.ones((2, 3)))
    optimizer.apply([keras.ops.ones((2, 3))], [w])
    print(keras.ops.convert_to_numpy(optimizer.member_iterations))  # [1 1]
    ```
    """

    def __init__(self, optimizers: Sequence[keras.optimizers.Optimizer], name=None, **kwargs):
        optimizers = list(optimizers)
        if not optimizers:
            raise ValueError(
                "Invalid value for argument `optimizers`: got an empty list. Pass one "
                "optimizer per member."
            )
        rule = _optimizer_rules.rule_for(optimizers[0])
        family = rule.family if rule is not None else None
        for i, optimizer in enumerate(optimizers):
            _check_member(i, optimizer, _optimizer_rules.rule_for(optimizer), family)
        kwargs.pop("learning_rate", None)
        super().__init__(learning_rate=0.0, name=name or "vectorized_optimizer", **kwargs)
        self.n_members = len(optimizers)
        self._rule = rule
        self._member_configs = [keras.optimizers.serialize(o) for o in optimizers]
        self._hypers = [rule.hyper(o) for o in optimizers]
        schedule = keras.optimizers.schedules.LearningRateSchedule
        self._schedules = [
            o._learning_rate if isinstance(o._learning_rate, schedule) else None for o in optimizers
        ]
        self._weight_decays = [o.weight_decay for o in optimizers]
        self._clips = {
            name: [_hyper_or_none(o, name) for o in optimizers] for name in _CLIP_OPTIONS
        }
        initial_rates = [
            0.0 if s is not None else float(ops.convert_to_numpy(o.learning_rate))
            for o, s in zip(optimizers, self._schedules)
        ]
        n = self.n_members
        self.member_mask = self.add_variable((n,), initializer="ones", name="member_mask")
        self.nonfinite = self.add_variable((n,), initializer="zeros", name="nonfinite")
        self.member_iterations = self.add_variable(
            (n,), initializer="zeros", dtype="int32", name="member_iterations"
        )
        self.member_learning_rate = self.add_variable(
            (n,), initializer="zeros", name="member_learning_rate"
        )
        self.member_learning_rate.assign(np.asarray(initial_rates, dtype="float32"))

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._slot_names = list(self._rule.slots(self._hypers))
        initial = self._rule.slots(self._hypers)
        self._slots = {}
        for name in self._slot_names:
            slot_variables = self.add_optimizer_variables(variables, name)
            values = np.asarray(initial[name], dtype="float32")
            if np.any(values != 0):
                for slot in slot_variables:
                    shape = (self.n_members,) + (1,) * (len(slot.shape) - 1)
                    slot.assign(ops.ones(slot.shape) * np.reshape(values, shape))
            self._slots[name] = slot_variables

    def _per_member(self, values, rank, dtype):
        values = np.asarray(values, dtype="float64").astype(keras.backend.standardize_dtype(dtype))
        return ops.convert_to_tensor(np.reshape(values, (self.n_members,) + (1,) * (rank - 1)))

    def _learning_rates(self):
        rates = ops.convert_to_tensor(self.member_learning_rate)
        if not any(s is not None for s in self._schedules):
            return rates
        steps = ops.convert_to_tensor(self.member_iterations)
        per_member = [
            rates[i] if s is None else ops.cast(s(steps[i]), "float32")
            for i, s in enumerate(self._schedules)
        ]
        return ops.stack(per_member)

    def _clip(self, grads):
        clips = self._clips
        rank_of = [len(g.shape) for g in grads]

        def member_sums(g):
            return ops.sum(ops.square(g), axis=tuple(range(1, len(g.shape))))

        if any(c is not None for c in clips["clipnorm"]):
            use = np.asarray([c is not None for c in clips["clipnorm"]])
            limits = [c if c is not None else 1.0 for c in clips["clipnorm"]]
            clipped = []
            for g, rank in zip(grads, rank_of):
                l2sum = ops.reshape(member_sums(g), (self.n_members,) + (1,) * (rank - 1))
                safe = ops.where(l2sum > 0, l2sum, ops.ones_like(l2sum))
                l2norm = ops.where(l2sum > 0, ops.sqrt(safe), l2sum)
                limit = self._per_member(limits, rank, g.dtype)
                c = (g * limit) / ops.maximum(l2norm, limit)
                clipped.append(ops.where(self._per_member(use, rank, "bool"), c, g))
            grads = clipped
        if any(c is not None for c in clips["global_clipnorm"]):
            use = [c is not None for c in clips["global_clipnorm"]]
            limit = np.asarray([c if c is not None else 1.0 for c in clips["global_clipnorm"]])
            norm = ops.sqrt(sum(member_sums(g) for g in grads))
            limit = ops.convert_to_tensor(limit.astype("float32"))
            scale = limit * ops.minimum(1.0 / norm, 1.0 / limit) + (norm - norm)
            scale = ops.where(ops.convert_to_tensor(np.asarray(use)), scale, ops.ones_like(scale))
            grads = [
                g * ops.reshape(scale, (self.n_members,) + (1,) * (rank - 1))
                for g, rank in zip(grads, rank_of)
            ]
        if any(c is not None for c in clips["clipvalue"]):
            values = [c if c is not None else np.inf for c in clips["clipvalue"]]
            clipped = []
            for g, rank in zip(grads, rank_of):
                limit = self._per_member(values, rank, g.dtype)
                clipped.append(ops.minimum(ops.maximum(g, -limit), limit))
            grads = clipped
        return grads

    def apply(self, grads, trainable_variables=None):
        """Update the stacked variables, one member's optimizer per slice.

        Args:
            grads: Gradients, one per trainable variable (`None` leaves it alone).
                Defaults to none (required).
            trainable_variables: The stacked variables, on the first call at least.
                Defaults to the variables the optimizer was built with.
        """
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the optimizer "
                    "must already be built. Call `optimizer.build(trainable_variables)` "
                    "first."
                )
            trainable_variables = self._trainable_variables
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if pairs:
            with keras.name_scope(self.name, caller=self):
                self._vectorized_update([g for g, _ in pairs], [v for _, v in pairs])
        self._iterations.assign_add(1)

    def _vectorized_update(self, grads, variables):
        from keras_gpushare.pack import replicas

        context = replicas.replica_context()
        if context is None:
            plan = self._plan(grads, variables)
            for g, variable in zip(plan[0], variables):
                self._update_variable(variable, g, *plan[1:], self._get_variable_index(variable))
            self._update_bookkeeping(self.nonfinite, self.member_iterations, *plan[1:3])
            return
        self._replicated_update(context, grads, variables)

    def _replicated_update(self, context, grads, variables):
        """The update on one replica of a `tf.distribute` strategy.

        The gradients are summed over the replicas first, so every replica works out the
        same update; then each replica's copy of every variable gets it, in the strategy's
        update context, as Keras's own optimizers do.
        """
        import tensorflow as tf

        grads = context.all_reduce("sum", list(grads))
        plan = self._plan(grads, variables)
        indices = [self._get_variable_index(v) for v in variables]

        def update(strategy, plan):
            extended = strategy.extended
            for g, variable, index in zip(plan[0], variables, indices):
                extended.update(
                    variable.value,
                    lambda v, *args, i=index: self._update_variable(v, *args, i),
                    args=(g, *plan[1:]),
                    group=False,
                )
            extended.update(
                self.nonfinite.value,
                lambda v, active, finite: self._update_bookkeeping(
                    v, self.member_iterations, active, finite
                ),
                args=plan[1:3],
                group=False,
            )

        tf.__internal__.distribute.interim.maybe_merge_call(update, context.strategy, plan)

    def _plan(self, grads, variables):
        """What every variable's update needs: `(grads, active, finite, rates, steps)`."""
        n = self.n_members
        grads = [ops.cast(ops.convert_to_tensor(g), v.dtype) for g, v in zip(grads, variables)]
        finite = ops.ones((n,), dtype="bool")
        for g in grads:
            finite = ops.logical_and(
                finite, ops.all(ops.isfinite(g), axis=tuple(range(1, len(g.shape))))
            )
        active = ops.logical_and(ops.convert_to_tensor(self.member_mask) > 0.5, finite)
        steps = ops.cast(ops.convert_to_tensor(self.member_iterations) + 1, "float32")
        return self._clip(grads), active, finite, self._learning_rates(), steps

    def _update_bookkeeping(self, nonfinite, member_iterations, active, finite):
        nonfinite.assign(ops.cast(ops.logical_not(finite), "float32"))
        member_iterations.assign_add(ops.cast(active, "int32"))

    def _update_variable(self, variable, g, active, finite, rates, steps, index):
        """Member i's optimizer step on slice i of `variable`, for every active member."""
        rank = len(variable.shape)
        shape = (self.n_members,) + (1,) * (rank - 1)
        lr = ops.cast(ops.reshape(rates, shape), variable.dtype)
        old = ops.convert_to_tensor(variable)
        value = old
        decays = self._weight_decays
        if any(w is not None for w in decays):
            wd = self._per_member([w or 0.0 for w in decays], rank, variable.dtype)
            value = value - value * wd * lr
        h = {
            name: self._per_member([hp[name] for hp in self._hypers], rank, variable.dtype)
            for name in self._hypers[0]
        }
        slots = {name: self._slots[name][index] for name in self._slot_names}
        old_slots = {name: ops.convert_to_tensor(s) for name, s in slots.items()}
        new_value, new_slots = self._rule.update(
            g, value, old_slots, h, lr, ops.cast(ops.reshape(steps, shape), variable.dtype)
        )
        keep = ops.reshape(active, shape)
        variable.assign(ops.where(keep, new_value, old))
        for name, slot in slots.items():
            slot.assign(ops.where(keep, new_slots[name], old_slots[name]))

    def _member_slot_pairs(self, optimizers, variable_map):
        """Yield `(member i, stacked slot, member slot)` for every slot both sides have."""
        trainable = {id(fused): members for fused, members in variable_map}
        for i, optimizer in enumerate(optimizers):
            member_variables = [trainable[id(v)][i] for v in self._trainable_variables]
            if not optimizer.built:
                optimizer.build(member_variables)
            member_slots = self._rule.member_slots(optimizer)
            for name, slot_list in member_slots.items():
                for fused, member_variable in zip(self._trainable_variables, member_variables):
                    stacked = self._slots[name][self._get_variable_index(fused)]
                    yield i, stacked, slot_list[optimizer._get_variable_index(member_variable)]

    def _check_optimizers(self, optimizers):
        optimizers = list(optimizers)
        if len(optimizers) != self.n_members:
            raise ValueError(
                f"Invalid value for argument `optimizers`: got {len(optimizers)} optimizers "
                f"for {self.n_members} members. Pass one optimizer per member."
            )
        if not self.built:
            raise ValueError(
                "The vectorized optimizer is not built yet. Call "
                "`optimizer.build(fused_model.trainable_variables)` first."
            )
        return optimizers

    def write_state_to(self, optimizers: Sequence[keras.optimizers.Optimizer], variable_map):
        """Copy each member's step count and slots into that member's own optimizer.

        Build each member optimizer on `member.trainable_variables` beforehand if it must
        save and load with the member model; an unbuilt one is built on the member
        variables in the order of the stacked ones.

        Args:
            optimizers: One Keras optimizer per member, of the classes this optimizer
                was made from. Defaults to none (required).
            variable_map: `FusedModel.member_variable_map(members)`: pairs of a stacked
                variable and the N member variables it holds. Defaults to none (required).
        """
        optimizers = self._check_optimizers(optimizers)
        steps = ops.convert_to_numpy(self.member_iterations)
        for i, optimizer in enumerate(optimizers):
            optimizer.iterations.assign(int(steps[i]))
        for i, stacked, member_slot in self._member_slot_pairs(optimizers, variable_map):
            member_slot.assign(ops.convert_to_numpy(stacked)[i])

    def read_state_from(self, optimizers: Sequence[keras.optimizers.Optimizer], variable_map):
        """Load each member optimizer's step count and slots into its slices.

        Args:
            optimizers: One Keras optimizer per member. Defaults to none (required).
            variable_map: `FusedModel.member_variable_map(members)`. Defaults to none
                (required).
        """
        optimizers = self._check_optimizers(optimizers)
        steps = [int(ops.convert_to_numpy(o.iterations)) for o in optimizers]
        self.member_iterations.assign(np.asarray(steps, dtype="int32"))
        updates = {}
        for i, stacked, member_slot in self._member_slot_pairs(optimizers, variable_map):
            value = updates.setdefault(id(stacked), (stacked, ops.convert_to_numpy(stacked)))[1]
            value[i] = ops.convert_to_numpy(member_slot)
        for stacked, value in updates.values():
            stacked.assign(value)

    def get_config(self):
        return {"name": self.name, "optimizers": self._member_configs}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizers"] = [
            keras.optimizers.deserialize(c, custom_objects=custom_objects)
            for c in config["optimizers"]
        ]
        return cls(**config)
