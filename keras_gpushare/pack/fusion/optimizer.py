"""`VectorizedOptimizer`: N members' optimizers applied to stacked variables at once."""

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack.fusion import _optimizer_families, _optimizer_state, _transforms
from keras_gpushare.pack.fusion import settings as settings_lib
from keras_gpushare.pack.fusion._member_settings import (
    MemberLearningRate,
    inner_optimizer,
    member_settings,
    outside_groups,
)
from keras_gpushare.pack.fusion.base import host_constant, host_zeros

logger = logging.getLogger(__name__)

_CLIP_OPTIONS = ("clipnorm", "global_clipnorm", "clipvalue")


@dataclasses.dataclass
class _StepContext:
    """What every group's update reads: per-member tensors of shape (N,), read once a step."""

    mask: Any
    iterations: Any
    steps: Any
    rates: Any
    divisor: Any
    states: dict


class _Reference:
    """Holds an object out of Keras's attribute tracking."""

    def __init__(self, value):
        self.value = value


@keras.saving.register_keras_serializable(package="keras_gpushare")
class VectorizedOptimizer(keras.optimizers.Optimizer):
    """N members' optimizers applied at once to variables stacked on a member axis.

    Member i's slice of every stacked variable is updated exactly as member i's own
    optimizer would update its own variables: its learning rate (or schedule, evaluated
    at its own step count), its hyperparameters, weight decay, gradient clipping, fixed or
    dynamic (mixed-precision) loss scaling and gradient accumulation, each taken over its
    own slices only. Members may use different optimizer families (Adam for some, SGD for
    others): each stretch of members of one family is updated by that family's rule, with
    no per-member loop.

    Variables are stacked per group: `groups` lists, for each group of fused members, the
    members whose slices its variables hold, in slice order (`set_variable_groups` says
    which variable belongs to which group; by default one group of all members).

    It also isolates members:

    - `member_mask` (optimizer variable, shape `(N,)`): 1.0 updates the member, 0.0
      freezes it; a frozen member's variables, slots and step count stay unchanged.
    - `nonfinite` (optimizer variable, shape `(N,)`): set at every step to 1.0 for each
      member whose gradients were not all finite and that got no update that step
      (always 0.0 with `skip_nonfinite=False`, unless a member's loss scale skipped it).

    Both are optimizer variables, so they work inside `stateless_apply` on JAX too.

    Setting the attribute `fuse_update` to `True` before the step is traced computes the
    update, on a TensorFlow CPU without XLA, in one XLA-compiled function of its own, which
    fuses its element-wise passes over the stacked weights and slots (a program built for
    slots runs every family's rule over every slot: the fused update took its steady epoch
    from 1.9 s to 1.3 s on 16 getting-started slots). It costs an XLA compile (and XLA's
    start-up, once a process), so it is off by default and ParallelTuner's slots executor
    sets it where the search's remaining steps repay that (docs/benchmarks.md, "A fused
    optimizer update"). Elsewhere (`can_fuse_update` is `False`) XLA already fuses the
    whole step, or no step is traced.

    Supported: SGD, Adam, AdamW, Adamax, Nadam, Lion, Lamb, RMSprop, Adagrad, Adadelta,
    Ftrl, and the classes given a rule with `register_optimizer_rule`, each optionally
    inside a `LossScaleOptimizer`.

    The update of a group is a chain of small transforms on the stacked gradients
    (`_transforms`: unscaling, the finiteness gate, gradient accumulation, clipping), then
    weight decay and each family's rule with the members' hyperparameters as data, and the
    old values kept for members that take no step.

    Args:
        optimizers: One Keras optimizer per member, not yet used or already built (their
            state is read with `read_state_from`). Defaults to none (required).
        groups: The members of each group of stacked variables, in slice order.
            Defaults to one group of all members.
        skip_nonfinite: leave a member unchanged in a step whose gradients are not all
            finite; `False` applies the step as Keras does (a member with a
            `LossScaleOptimizer` still skips it, as that optimizer does). Defaults to
            `True`.
        settings: how the members' optimizer settings are held: `"constants"` of the
            compiled step, or `"held"` as data, each member's optimizer family, float
            hyperparameters and weight decay, so that `load_member` takes an optimizer of
            any family the members were built with (each family's rule is computed for
            every member of a group that holds it). A `fusion.settings` object or its
            name. Defaults to `"constants"`.
        name: Name of the optimizer. Defaults to `"vectorized_optimizer"`.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion import VectorizedOptimizer

    optimizer = VectorizedOptimizer(
        [keras.optimizers.Adam(1e-3), keras.optimizers.SGD(1e-2, momentum=0.9)]
    )
    w = keras.Variable(keras.ops.ones((2, 3)))
    optimizer.apply([keras.ops.ones((2, 3))], [w])
    print(keras.ops.convert_to_numpy(optimizer.member_iterations))  # [1 1]
    ```
    """

    def __init__(
        self,
        optimizers: Sequence[keras.optimizers.Optimizer],
        groups=None,
        skip_nonfinite=True,
        settings=None,
        name=None,
        **kwargs,
    ):
        optimizers = list(optimizers)
        if not optimizers:
            raise ValueError(
                "Invalid value for argument `optimizers`: got an empty list. Pass one "
                "optimizer per member."
            )
        n = len(optimizers)
        groups = [tuple(range(n))] if groups is None else [tuple(int(i) for i in g) for g in groups]
        grouped = {i for g in groups for i in g}
        per_member = [
            member_settings(i, o) if i in grouped else outside_groups()
            for i, o in enumerate(optimizers)
        ]
        kwargs.pop("learning_rate", None)
        super().__init__(learning_rate=0.0, name=name or "vectorized_optimizer", **kwargs)
        self.n_members = n
        self.skip_nonfinite = bool(skip_nonfinite)
        self.settings = settings_lib.named(settings)
        self._member_settings = per_member
        self._groups = groups
        # A slot program's constants, fixed by the members it is built with.
        self._families = [_optimizer_families.families(per_member, ids) for ids in groups]
        self._stand_ins = _optimizer_families.stand_ins(per_member)
        self._slot_names = [
            {
                rule: set(rule.slots(_optimizer_families.run_hypers(per_member, ids, rule, hyper)))
                for rule, hyper in self._stand_ins.items()
                if rule in rules
            }
            for ids, rules in zip(groups, self._families)
        ]
        self._decays = any(s.weight_decay is not None for s in per_member)
        self._names = [inner_optimizer(o).name for o in optimizers]
        # Members outside the groups keep their own optimizers (held, not tracked: they
        # are the members', saved with them).
        self._outside = _Reference({i: o for i, o in enumerate(optimizers) if i not in grouped})
        self._member_configs = [keras.optimizers.serialize(o) for o in optimizers]
        self._variable_groups: dict[int, int] = {}
        self._loss_scale_ref = _Reference(None)
        self.fuse_update = False
        self._fused_update = _Reference(None)
        self.member_mask = self.add_variable((n,), initializer="ones", name="member_mask")
        self.nonfinite = self.add_variable((n,), initializer="zeros", name="nonfinite")
        self.member_iterations = self.add_variable(
            (n,), initializer="zeros", dtype="int32", name="member_iterations"
        )
        self.member_learning_rate = self.add_variable(
            (n,), initializer="zeros", name="member_learning_rate"
        )
        self.member_learning_rate.assign(
            np.asarray([s.learning_rate for s in per_member], dtype="float32")
        )

    # Configuration -------------------------------------------------------------------

    def add_variable(self, shape, initializer="zeros", *args, **kwargs):
        """Keras's `add_variable`; zeros are made on the host (no program per slot shape)."""
        if isinstance(initializer, str) and initializer == "zeros":
            initializer = host_zeros
        return super().add_variable(shape, initializer, *args, **kwargs)

    def set_variable_groups(self, variable_groups):
        """Says which group each stacked variable belongs to.

        Args:
            variable_groups: pairs `(variable, group index)`. Defaults to none (required).
        """
        self._variable_groups = {id(v): g for v, g in variable_groups}

    def attach_loss_scale(self, variable):
        """Uses `variable` (shape (N,), the pack's) for the members' dynamic loss scales.

        The pack multiplies member i's loss by `variable[i]` (and by its fixed
        `loss_scale_factor`); its gradient with respect to `variable[i]` is then member i's
        loss, finite exactly when the member trained this step. This optimizer unscales
        each member's gradients, and updates `variable` as Keras's `LossScaleOptimizer`
        updates its scale, instead of a gradient step.
        """
        self._loss_scale_ref = _Reference(variable)

    @property
    def loss_scale_variable(self):
        """The pack's loss-scale variable, or `None` (held, not tracked: it is the pack's)."""
        return self._loss_scale_ref.value

    @property
    def uses_dynamic_loss_scale(self):
        """Whether some member trains with a `LossScaleOptimizer` (mixed precision)."""
        return any(s.dynamic_scale is not None for s in self._member_settings)

    def initial_loss_scales(self):
        """Each member's initial dynamic loss scale (1.0 for members without one)."""
        return np.asarray(
            [s.dynamic_scale[0] if s.dynamic_scale else 1.0 for s in self._member_settings],
            "float32",
        )

    def loss_scale_factors(self):
        """Each member's fixed `loss_scale_factor` (1.0 where none is set)."""
        return np.asarray([s.loss_scale_factor or 1.0 for s in self._member_settings], "float32")

    def member_schedule(self, index):
        """Member `index`'s learning-rate schedule, or `None`."""
        return self._member_settings[index].schedule

    def member_learning_rates(self):
        """Every member's current learning rate, as a NumPy array."""
        rates = ops.convert_to_numpy(self._learning_rates()).copy()
        for i, optimizer in self._outside.value.items():
            rates[i] = float(ops.convert_to_numpy(optimizer.learning_rate))
        return rates

    def set_member_learning_rate(self, index, value):
        """Sets member `index`'s fixed learning rate."""
        rates = ops.convert_to_numpy(self.member_learning_rate).copy()
        rates[index] = value
        self.member_learning_rate.assign(rates)

    def load_member(self, index, optimizer):
        """Gives member `index` the learning rate of `optimizer` and a fresh state.

        With settings as constants, `optimizer` must be of the member's family with the
        same hyperparameters but for its learning rate; with settings held as data, of one
        of the families the members were built with, its hyperparameters and weight decay
        its own (the caller checks `load_problem`). The rest are constants of the compiled
        step.

        Args:
            index: the member. Defaults to none (required).
            optimizer: the Keras optimizer whose settings the member takes. Defaults to
                none (required).
        """
        settings = member_settings(index, optimizer)
        taken = self.settings.loaded_optimizer_fields
        self._member_settings[index] = dataclasses.replace(
            self._member_settings[index],
            learning_rate=settings.learning_rate,
            **{name: getattr(settings, name) for name in taken},
        )
        self._member_configs[index] = keras.optimizers.serialize(optimizer)
        self._names[index] = inner_optimizer(optimizer).name
        if self.settings.held and self.built:
            self._write_held_settings(index)
        self.reset_member(index)

    def load_problem(self, index, optimizer):
        """Why member `index` cannot take `optimizer` in place (`load_member`), or `None`.

        Only with settings held as data: with constants the caller compares the
        optimizers.

        Args:
            index: the member. Defaults to none (required).
            optimizer: a Keras optimizer. Defaults to none (required).
        """
        try:
            settings = member_settings(index, optimizer)
        except ValueError as e:
            return str(e)
        group = next(g for g, ids in enumerate(self._groups) if index in ids)
        return _optimizer_families.load_problem(
            self._member_settings[index],
            settings,
            self._families[group],
            self._slot_names[group],
            self._decays,
        )

    def reset_member(self, index):
        """Puts member `index`'s optimizer state back to a new optimizer's.

        Its step count, slots, per-member state, accumulated gradients, loss scale and
        learning rate take the values it had when the pack was compiled; the other members'
        are left as they are.

        Args:
            index: the member. Defaults to none (required).
        """
        settings = self._member_settings[index]
        _set_row(self.member_iterations, index, 0)
        _set_row(self.nonfinite, index, 0.0)
        if settings.schedule is None:
            _set_row(self.member_learning_rate, index, settings.learning_rate)
        if not self.built or settings.rule is None:
            return
        for name, values in settings.rule.initial_state([settings.hyper]).items():
            _set_row(self._states[name], index, values[0])
        for k, by_run in self._slots.items():
            group = self._group_of[k]
            ids = self._groups[group]
            if index not in ids:
                continue
            position = ids.index(index)
            for (r, name), slot in by_run.items():
                _, start, end = self._group_runs[group][r]
                if start <= position < end:
                    initial = self._initial_slot(group, r, name)[position - start]
                    _set_row(slot, position - start, initial)
            if self._accumulators is not None:
                _set_row(self._accumulators[k], position, 0.0)
        if self.loss_scale_variable is not None and self.scale_counter is not None:
            _set_row(self.loss_scale_variable, index, self.initial_loss_scales()[index])
            _set_row(self.scale_counter, index, 0)

    @property
    def optimizers(self):
        """One object per member whose `learning_rate` reads and sets that member's rate.

        Keras's learning-rate callbacks and TensorBoard look for an `optimizers` attribute
        and act on each entry.
        """
        outside = self._outside.value
        return [
            outside[i] if i in outside else MemberLearningRate(self, i, name)
            for i, name in enumerate(self._names)
        ]

    @property
    def learning_rate(self):
        """The members' common learning rate; setting it sets every member's."""
        rates = self.member_learning_rates()
        if np.any(rates != rates[0]):
            raise ValueError(
                "The members of this ModelPack have different learning rates "
                f"({rates.tolist()}), so the pack has no single `learning_rate`. Read or "
                "set each member's with `pack.optimizer.optimizers[i].learning_rate`."
            )
        return ops.convert_to_tensor(rates[0])

    @learning_rate.setter
    def learning_rate(self, value):
        if not hasattr(self, "_member_settings"):
            # The base class sets its own (unused) rate while it is constructed.
            keras.optimizers.Optimizer.learning_rate.fset(self, value)
            return
        for handle in self.optimizers:
            handle.learning_rate = value

    def finalize_variable_values(self, var_list):
        """Lets the optimizers of members outside the groups finalize their weights."""
        for optimizer in self._outside.value.values():
            if optimizer.built:
                optimizer.finalize_variable_values(_upstream.optimizer_variables_list(optimizer))

    # State ---------------------------------------------------------------------------

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._group_of = [self._variable_groups.get(id(v), 0) for v in variables]
        self._group_runs = [
            self.settings.optimizer_runs([self._member_settings[i].rule for i in ids], families)
            for ids, families in zip(self._groups, self._families)
        ]
        self._slots = {k: {} for k in range(len(variables))}
        # The members' families, each once in member order: with settings as constants no
        # member changes family; held as data, a loaded member's is among these.
        rules = list(self._stand_ins)
        for rule in rules:
            names = {}
            for group, runs in enumerate(self._group_runs):
                for r, (run_rule, _, _) in enumerate(runs):
                    if run_rule is rule:
                        names.update(dict.fromkeys(self._run_slot_names(group, r)))
            for name in names:
                for k, variable in enumerate(variables):
                    self._add_run_slots(rule, name, k, variable)
        self._states = {}
        for rule in rules:
            hypers = [s.hyper for s in self._member_settings]
            for name, values in rule.initial_state(hypers).items():
                # Initializers, not assignments: Keras may build the optimizer in a
                # stateless scope, where an assignment would be lost.
                self._states[name] = self.add_variable(
                    (self.n_members,),
                    initializer=keras.initializers.Constant(np.asarray(values, "float32")),
                    name=name,
                )
        self._hyper_values = {}
        self.member_family = self.member_weight_decay = None
        if self.settings.held:
            self._add_slot_variables(rules)
        self._accumulators = None
        if any(s.accumulation for s in self._member_settings):
            self._accumulators = [
                self.add_variable_from_reference(v, name="accumulated_gradient") for v in variables
            ]
        self.scale_counter = None
        if self.uses_dynamic_loss_scale:
            self.scale_counter = self.add_variable(
                (self.n_members,), initializer="zeros", dtype="int32", name="scale_counter"
            )

    def _run_hypers(self, group, r):
        """The hyperparameters run `r` of `group` is computed with, member by member."""
        rule, a, b = self._group_runs[group][r]
        ids = self._groups[group][a:b]
        return _optimizer_families.run_hypers(
            self._member_settings, ids, rule, self._stand_ins[rule]
        )

    def _run_slot_names(self, group, r):
        """The slots run `r` of `group` holds: with settings held as data, those of every
        member the program was built with."""
        rule = self._group_runs[group][r][0]
        return self.settings.run_slot_names(
            rule, self._run_hypers(group, r), self._slot_names[group][rule]
        )

    def _initial_slot(self, group, r, name):
        """Slot `name` of run `r` of `group` as a new optimizer has it, member by member
        (zeros for a slot only some members' settings need, as Keras's)."""
        _, a, b = self._group_runs[group][r]
        hypers = self._run_hypers(group, r)
        return self._group_runs[group][r][0].slots(hypers).get(name, [0.0] * (b - a))

    def _add_slot_variables(self, rules):
        """A slot program's per-member family, hyperparameters and weight decay."""
        n = self.n_members
        for rule in rules:
            stand_in = self._stand_ins[rule]
            family = [s.hyper if s.rule is rule else stand_in for s in self._member_settings]
            self._hyper_values[rule] = {
                key: self.add_variable(
                    (n,),
                    initializer=host_constant([h[key] for h in family]),
                    name=f"{type(rule).__name__.strip('_').lower()}_{key}",
                )
                for key in stand_in
            }
        codes = [rules.index(s.rule) if s.rule in rules else -1 for s in self._member_settings]
        self.member_family = self.add_variable(
            (n,), initializer=host_constant(codes), dtype="int32", name="member_family"
        )
        if self._decays:
            self.member_weight_decay = self.add_variable(
                (n,),
                initializer=host_constant([s.weight_decay or 0.0 for s in self._member_settings]),
                name="member_weight_decay",
            )

    def _write_held_settings(self, index):
        """Member `index`'s rows of the slot program's variables take its settings."""
        settings = self._member_settings[index]
        rules = list(self._hyper_values)
        for key, variable in self._hyper_values[settings.rule].items():
            _set_row(variable, index, settings.hyper[key])
        _set_row(self.member_family, index, rules.index(settings.rule))
        if self.member_weight_decay is not None:
            _set_row(self.member_weight_decay, index, settings.weight_decay or 0.0)

    def _add_run_slots(self, rule, name, k, variable):
        group = self._group_of[k]
        for r, (run_rule, a, b) in enumerate(self._group_runs[group]):
            if run_rule is not rule or name not in self._run_slot_names(group, r):
                continue
            initial = self._initial_slot(group, r, name)
            shape = (b - a, *variable.shape[1:])
            values = np.asarray(initial, dtype="float32")
            if shape == tuple(variable.shape) and not np.any(values != 0):
                slot = self.add_variable_from_reference(variable, name=name)
            else:
                per_member = np.reshape(values, (b - a,) + (1,) * (len(shape) - 1))
                slot = self.add_variable(
                    shape,
                    initializer=keras.initializers.Constant(per_member),
                    dtype=variable.dtype,
                    name=name,
                )
            self._slots[k][(r, name)] = slot

    # Update ----------------------------------------------------------------------------

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
            trainable_variables = self.stacked_variables
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        scale = self.loss_scale_variable
        if scale is not None:
            pairs = [(g, v) for g, v in pairs if v is not scale]
            scale_grad = next(
                (g for g, v in zip(grads, trainable_variables) if v is scale and g is not None),
                None,
            )
        if pairs:
            with keras.name_scope(self.name, caller=self):
                grads = [ops.convert_to_tensor(g) for g, _ in pairs]
                variables = [v for _, v in pairs]
                self._vectorized_update(grads, variables, None if scale is None else scale_grad)
        _upstream.iterations_variable(self).assign_add(1)

    def _vectorized_update(self, grads, variables, scale_grad):
        from keras_gpushare.pack import _replicas

        context = _replicas.replica_context()
        if context is not None:
            grads = context.all_reduce("sum", list(grads))
            if scale_grad is not None:
                scale_grad = context.all_reduce("sum", scale_grad)
        if context is None and self._fuses_update():
            updates = self._fused_new_values(grads, variables, scale_grad)
        else:
            updates = self._new_values(grads, variables, scale_grad)
        if context is None:
            for variable, value in updates:
                variable.assign(value)
            return

        def assign_all(strategy, values):
            for (variable, _), value in zip(updates, values):
                strategy.extended.update(
                    variable.value, lambda v, x: v.assign(x), args=(value,), group=False
                )

        _upstream.maybe_merge_call(assign_all, context.strategy, [value for _, value in updates])

    @property
    def can_fuse_update(self):
        """Whether `fuse_update` changes anything here: on TensorFlow, whose kernels on a
        CPU fuse no element-wise operations (within a step compiled whole with XLA, or on
        another backend, the update is fused already)."""
        return BACKEND.xla_optional and not BACKEND.fuses_elementwise()

    def _fuses_update(self):
        """Whether this step's update is compiled apart with XLA (`_fused_new_values`):
        with `fuse_update`, in a step traced on TensorFlow that fuses no element-wise
        operations (a CPU, no XLA), with learning-rate schedules of Keras's own only (a
        schedule of the user's may hold what XLA cannot compile)."""
        if not (self.fuse_update and BACKEND.xla_optional) or BACKEND.fuses_elementwise():
            return False
        import tensorflow as tf

        schedules = [s.schedule for s in self._member_settings if s.schedule is not None]
        return tf.inside_function() and all(
            type(s).__module__.startswith("keras.") for s in schedules
        )

    def _fused_new_values(self, grads, variables, scale_grad):
        """`_new_values`, computed by one XLA-compiled function (traced once per set of
        variables) whose results are assigned here, in the step."""
        import tensorflow as tf

        key = (tuple(id(v) for v in variables), scale_grad is None)
        if self._fused_update.value is None or self._fused_update.value[0] != key:
            targets: list = []

            def new_values(grads, scale_grad):
                updates = self._new_values(grads, variables, scale_grad)
                targets[:] = [variable for variable, _ in updates]
                return [value for _, value in updates]

            function = tf.function(new_values, jit_compile=True, autograph=False)
            self._fused_update = _Reference((key, function, targets))
        _, function, targets = self._fused_update.value
        values = function(list(grads), scale_grad)
        return list(zip(targets, values))

    def _learning_rates(self):
        rates = ops.convert_to_tensor(self.member_learning_rate)
        if not any(s.schedule is not None for s in self._member_settings):
            return rates
        steps = ops.convert_to_tensor(self.member_iterations)
        per_member = [
            rates[i] if s.schedule is None else ops.cast(s.schedule(steps[i]), "float32")
            for i, s in enumerate(self._member_settings)
        ]
        return ops.stack(per_member)

    def _new_values(self, grads, variables, scale_grad):
        """Every variable's new value after this step: `[(variable, value)]`.

        Each group is updated as one block; the members' flags and per-member state are put
        back in member order with one gather each. Tracing cost grows with the operations
        made here, so per-member constants and reshapes are made once per group and rank.
        """
        n = self.n_members
        mask = ops.convert_to_tensor(self.member_mask) > 0.5
        iterations = ops.convert_to_tensor(self.member_iterations)
        # With gradient accumulation Keras counts an optimizer step per `k` applications.
        periods = np.asarray([s.accumulation or 1 for s in self._member_settings], "int32")
        if np.all(periods == 1):
            steps = ops.cast(iterations + 1, "float32")
        else:
            steps = ops.cast(ops.floor_divide(iterations, periods) + 1, "float32")
        rates = self._learning_rates()
        dynamic = self.loss_scale_variable is not None and self.uses_dynamic_loss_scale
        divisor = None
        if dynamic or np.any(self.loss_scale_factors() != 1.0):
            divisor = ops.convert_to_tensor(self.loss_scale_factors())
            if dynamic:
                divisor = divisor * ops.convert_to_tensor(self.loss_scale_variable)
        index = {id(v): k for k, v in enumerate(self.stacked_variables)}
        states = {name: ops.convert_to_tensor(s) for name, s in self._states.items()}
        context = _StepContext(mask, iterations, steps, rates, divisor, states)
        updates = []
        order = []
        flags = ([], [], [])
        group_states = []
        for group, ids in enumerate(self._groups):
            members = [(self._variable_index(v, index), g, v) for g, v in zip(grads, variables)]
            members = [(k, g, v) for k, g, v in members if self._group_of[k] == group]
            if not members:
                continue
            group_updates, finite, active, updated, advanced = self._group_step(
                group, ids, members, context
            )
            updates.extend(group_updates)
            order.extend(ids)
            for flag, value in zip(flags, (finite, active, updated)):
                flag.append(value)
            group_states.append((ids, advanced))
        rest = [i for i in range(n) if i not in set(order)]
        # Members outside the groups, or without gradients: finite, not trained.
        if rest:
            for flag, value in zip(flags, (True, False, False)):
                flag.append(ops.convert_to_tensor(np.full((len(rest),), value)))
        positions = np.argsort(np.asarray(order + rest, "int64")).astype("int32")
        in_order = bool(np.all(positions == np.arange(n)))

        def in_member_order(pieces):
            joined = pieces[0] if len(pieces) == 1 else ops.concatenate(pieces, axis=0)
            return joined if in_order else ops.take(joined, positions, axis=0)

        finite_all, active_all, updated_all = (in_member_order(f) for f in flags)
        updates.append((self.nonfinite, ops.cast(ops.logical_not(finite_all), "float32")))
        updates.append((self.member_iterations, iterations + ops.cast(active_all, "int32")))
        for name, state in self._states.items():
            if not any(name in advanced for _, advanced in group_states):
                continue
            pieces = [
                advanced[name] if name in advanced else _transforms.rows_of(states[name], ids)
                for ids, advanced in group_states
            ]
            if rest:
                pieces.append(_transforms.rows_of(states[name], rest))
            updates.append((state, ops.where(updated_all, in_member_order(pieces), states[name])))
        if dynamic:
            updates.extend(self._scale_updates(finite_all, scale_grad))
        return updates

    def _variable_index(self, variable, index):
        k = index.get(id(variable))
        if k is None:
            raise ValueError(
                f"Variable {variable.path} was not given to this optimizer when it was built."
            )
        return k

    def _gradient_transform(self, settings, members, context, pick):
        """The transforms of a group's gradients before its rules, as one."""
        return _transforms.chain(
            _transforms.unscale(None if context.divisor is None else pick(context.divisor)),
            _transforms.apply_if_finite(
                pick(context.mask),
                self.skip_nonfinite,
                [s.dynamic_scale is not None for s in settings],
            ),
            _transforms.multi_steps(
                [s.accumulation or 1 for s in settings],
                pick(context.iterations),
                self._accumulators and [self._accumulators[k] for k, _, _ in members],
            ),
            _transforms.clip(*([s.clip[name] for s in settings] for name in _CLIP_OPTIONS)),
        )

    def _group_step(self, group, ids, members, context):
        """One group's update; returns its updates, its flags (k,) and its advanced state."""
        settings = [self._member_settings[i] for i in ids]
        take = np.asarray(ids, "int32")

        def pick(vector):
            return _transforms.rows_of(vector, ids)

        gradient_step = self._gradient_transform(settings, members, context, pick)
        step = gradient_step(
            _transforms.GradientStep([ops.cast(g, v.dtype) for _, g, v in members])
        )
        hyper = _transforms.MemberHyperparameters(
            self._group_runs[group],
            [s.hyper for s in settings],
            pick(context.rates),
            pick(context.steps),
            [s.weight_decay for s in settings],
            self._slot_hyperparameters(group, pick) if self.settings.held else None,
        )
        run_states, advanced = _transforms.advance_rule_states(hyper, context.states, take, pick)
        kept = []
        for (k, _, variable), g in zip(members, step.grads):
            old_slots = {key: ops.convert_to_tensor(slot) for key, slot in self._slots[k].items()}
            old = ops.convert_to_tensor(variable)
            new, new_slots = _transforms.apply_rule(
                g, _transforms.decay(old, hyper), old_slots, hyper, run_states
            )
            for r, (_, a, b) in enumerate(hyper.runs):
                for name, value in new_slots[r].items():
                    kept.append((self._slots[k][(r, name)], value, old_slots[(r, name)], (a, b)))
            kept.append((variable, new, old, (0, len(ids))))
        updates = [*step.updates, *_transforms.keep_unchanged(kept, step.updated)]
        return updates, step.finite, step.active, step.updated, advanced

    def _slot_hyperparameters(self, group, pick):
        """A slot program's choices for `group`, read from its variables this step."""
        rules = list(self._hyper_values)
        family = pick(ops.convert_to_tensor(self.member_family))
        runs = self._group_runs[group]
        decay = self.member_weight_decay
        return _transforms.SlotHyperparameters(
            run_hypers=[self._run_hypers(group, r) for r in range(len(runs))],
            hypers=[
                {key: pick(ops.convert_to_tensor(v)) for key, v in self._hyper_values[rule].items()}
                for rule, _, _ in runs
            ],
            families=[ops.equal(family, rules.index(rule)) for rule, _, _ in runs],
            weight_decay=None if decay is None else pick(ops.convert_to_tensor(decay)),
        )

    def _scale_updates(self, finite, scale_grad):
        """The dynamic loss scales' update, as Keras's `LossScaleOptimizer` makes it."""
        trained = np.asarray([s.dynamic_scale is not None for s in self._member_settings])
        new_scale, new_counter = _transforms.dynamic_loss_scale(
            ops.convert_to_tensor(self.loss_scale_variable),
            ops.convert_to_tensor(self.scale_counter),
            finite,
            [s.dynamic_scale[1] if s.dynamic_scale else 1 for s in self._member_settings],
            ops.convert_to_tensor(trained),
            scale_grad,
        )
        return [(self.loss_scale_variable, new_scale), (self.scale_counter, new_counter)]

    # Members' own optimizers ---------------------------------------------------------

    @property
    def stacked_variables(self):
        """The stacked variables this optimizer was built with, in slot order."""
        return list(_upstream.optimizer_variables_list(self))

    def member_settings(self, index):
        """What this optimizer keeps of member `index`'s optimizer (`MemberSettings`)."""
        return self._member_settings[index]

    @property
    def member_states(self):
        """`{name: (N,) variable}`: the rules' per-member scalar state (Nadam's, ...)."""
        return dict(self._states)

    def member_slots(self, member_ids, j):
        """Member `j` of group `member_ids`: its row in its run's slots and those slots.

        Returns:
            `(row, {(variable index, slot name): stacked slot})`, the slots of the run of
            members sharing member `j`'s rule, member `j`'s slice at `row` of each.
        """
        group = self._groups.index(tuple(member_ids))
        rule = self._member_settings[member_ids[j]].rule
        run, (_, start, _) = next(
            (r, run)
            for r, run in enumerate(self._group_runs[group])
            if run[0] is rule and run[1] <= j < run[2]
        )
        slots = {
            (k, name): slot
            for k, by_run in self._slots.items()
            for (r, name), slot in by_run.items()
            if r == run and self._group_of[k] == group
        }
        return j - start, slots

    def accumulator(self, k):
        """The gradient accumulator of stacked variable `k`, or `None` without accumulation."""
        return None if self._accumulators is None else self._accumulators[k]

    def write_state_to(
        self, optimizers: Sequence[keras.optimizers.Optimizer], variable_map, member_ids=None
    ):
        """Copy each member's step count, rate and slots into that member's own optimizer.

        Build each member optimizer on `member.trainable_variables` beforehand if it must
        save and load with the member model; an unbuilt one is built on the member
        variables in the order of the stacked ones.

        Args:
            optimizers: One Keras optimizer per member of `member_ids`, of the classes this
                optimizer was made from. Defaults to none (required).
            variable_map: `FusedModel.member_variable_map(members)`: each stacked variable
                with the member variables it holds. Defaults to none (required).
            member_ids: The group's members, in slice order. Defaults to all members.
        """
        _optimizer_state.write_state_to(self, optimizers, variable_map, member_ids)

    def read_state_from(
        self, optimizers: Sequence[keras.optimizers.Optimizer], variable_map, member_ids=None
    ):
        """Load each member optimizer's step count, rate and slots into its slices.

        Args:
            optimizers: One Keras optimizer per member of `member_ids`. Defaults to none
                (required).
            variable_map: `FusedModel.member_variable_map(members)`. Defaults to none
                (required).
            member_ids: The group's members, in slice order. Defaults to all members.
        """
        _optimizer_state.read_state_from(self, optimizers, variable_map, member_ids)

    def get_config(self):
        return {
            "name": self.name,
            "optimizers": self._member_configs,
            "groups": self._groups,
            "skip_nonfinite": self.skip_nonfinite,
            "settings": self.settings.name,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizers"] = [
            keras.optimizers.deserialize(c, custom_objects=custom_objects)
            for c in config["optimizers"]
        ]
        return cls(**config)


def _set_row(variable, row, value):
    """Assigns `value` to row `row` (the first axis) of `variable`, leaving the others."""
    values = np.array(ops.convert_to_numpy(variable))
    values[row] = value
    variable.assign(values)
