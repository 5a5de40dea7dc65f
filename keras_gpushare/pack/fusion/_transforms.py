"""The steps of `VectorizedOptimizer`'s update, as small transforms on stacked tensors.

A group of `k` fused members holds each variable and gradient as one tensor of shape
`(k, ...)`, member `j`'s slice first. Each transform here does one thing to those tensors,
for every member at once with that member's own settings, and takes and returns its state
explicitly, as optax's do: the gradient transforms (`unscale`, `apply_if_finite`,
`multi_steps`, `clip`) map a `GradientStep` to the next and `chain` composes them;
`MemberHyperparameters` holds the members' learning rates and hyperparameters as per-member
tensors (optax's `inject_hyperparams`; in a slot program, `SlotHyperparameters`: read from
variables, with the optimizer family itself a per-member choice), `advance_rule_states`,
`decay` and `apply_rule` make the update itself, `keep_unchanged` keeps the old values of
members that take no step, and `dynamic_loss_scale` updates the members' mixed-precision loss
scales.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import numpy.typing as npt
from keras import ops

from keras_gpushare.pack._backend import BACKEND


def per_member(values: npt.ArrayLike, rank: int, dtype: Any) -> Any:
    """A constant `(k, 1, ...)` tensor of per-member `values`, to broadcast at `rank`."""
    values = np.asarray(values, dtype="float64").astype(keras.backend.standardize_dtype(dtype))
    return ops.convert_to_tensor(np.reshape(values, (len(values),) + (1,) * (rank - 1)))


def member_axis(vector: Any, rank: int, dtype: Any = None) -> Any:
    """A `(k,)` tensor shaped `(k, 1, ...)` to broadcast against rank-`rank` slices."""
    value = ops.reshape(vector, (vector.shape[0],) + (1,) * (rank - 1))
    return value if dtype is None else ops.cast(value, dtype)


def rows_of(values: Any, ids: Sequence[int]) -> Any:
    """The rows `ids` of `values` (one row a member), in that order: `values` itself when
    `ids` are every member in order, so that a step gathers nothing."""
    if list(ids) == list(range(values.shape[0])):
        return values
    return ops.take(values, np.asarray(ids, "int32"), axis=0)


def runs(rules: Sequence[Any]) -> list[tuple[Any, int, int]]:
    """`[(rule, start, stop)]`: the maximal stretches of members sharing a rule."""
    stretches: list[tuple[Any, int, int]] = []
    for j, rule in enumerate(rules):
        if stretches and stretches[-1][0] is rule:
            stretches[-1] = (rule, stretches[-1][1], j + 1)
        else:
            stretches.append((rule, j, j + 1))
    return stretches


def run_parts(tensor: Any, group_runs: Sequence[tuple[Any, int, int]]) -> list[Any]:
    """`tensor`'s slices along the member axis, one per run `(rule, a, b)`.

    On TensorFlow one split of known sizes (one operation, where slices make one each and
    three constants).
    """
    if len(group_runs) == 1:
        return [tensor]
    if BACKEND.split_in_one_op:
        import tensorflow as tf

        return tf.split(tensor, [b - a for _, a, b in group_runs], axis=0)
    return [tensor[a:b] for _, a, b in group_runs]


@dataclasses.dataclass(frozen=True)
class GradientStep:
    """A group's gradients and per-member flags, handed from one transform to the next.

    Attributes:
        grads: the gradients, one `(k, ...)` tensor per variable.
        finite: `(k,)` bool, whether each member's gradients were all finite (`None`
            before `apply_if_finite`).
        active: `(k,)` bool, the members that take this step.
        updated: `(k,)` bool, the members whose weights and slots change this step.
        updates: `[(variable, value)]`, the assignments the transforms made (accumulators).
    """

    grads: list
    finite: Any = None
    active: Any = None
    updated: Any = None
    updates: tuple = ()


GradientTransform = Callable[[GradientStep], GradientStep]


def chain(*transforms: GradientTransform) -> GradientTransform:
    """The transforms applied one after the other, as one (optax's `chain`)."""

    def chained(step: GradientStep) -> GradientStep:
        for transform in transforms:
            step = transform(step)
        return step

    return chained


def unscale(divisor: Any) -> GradientTransform:
    """Divides member `j`'s gradients by `divisor[j]` (its loss scale); `None` leaves them."""

    def transform(step: GradientStep) -> GradientStep:
        if divisor is None:
            return step
        grads = [g / member_axis(divisor, len(g.shape), g.dtype) for g in step.grads]
        return dataclasses.replace(step, grads=grads)

    return transform


# A gradient of at most this many elements a member joins the others of its dtype in one
# finiteness check (one kernel for them all); a larger one is checked where it is made, as
# copying it would cost each step more than the kernels joining saves.
_JOINED_AT_MOST = 128


def _all_finite(grads: Sequence[Any]) -> Any:
    """`(k,)` bool: whether each member's gradients are all finite.

    Each gradient times zero is summed member by member: zero where its elements are all
    finite, NaN where one is not (infinity or NaN times zero is NaN, and a sum keeps a NaN),
    and no finite value can overflow it. XLA fuses the product into the sum and adds the
    sums in one kernel, where a boolean `all` of `isfinite` took more kernels (a compiled
    step's size, hence its compile time, goes by its kernels). Small gradients (biases,
    mostly) of one dtype are laid side by side and summed together; larger ones as they
    lie.
    """
    k = grads[0].shape[0]
    sums: list = []
    small: dict[str, list] = {}
    for g in grads:
        if int(np.prod(g.shape[1:], dtype="int64")) <= _JOINED_AT_MOST:
            dtype = keras.backend.standardize_dtype(g.dtype)
            small.setdefault(dtype, []).append(ops.reshape(g, (k, -1)))
        else:
            # Reduced as it lies: flattening it first may copy it (XLA's layouts).
            sums.append(_zero_sum(g, axis=tuple(range(1, len(g.shape)))))
    for pieces in small.values():
        joined = pieces[0] if len(pieces) == 1 else ops.concatenate(pieces, axis=1)
        sums.append(_zero_sum(joined, axis=(1,)))
    total = sums[0]
    for more in sums[1:]:
        total = ops.add(total, more)
    return ops.isfinite(total)


def _zero_sum(g: Any, axis: tuple[int, ...]) -> Any:
    """Per member, the float32 sum of `g` times zero over `axis`: 0 or NaN."""
    return ops.cast(ops.sum(ops.multiply(g, ops.zeros((), g.dtype)), axis=axis), "float32")


def apply_if_finite(mask: Any, skip_nonfinite: bool, scaled: Sequence[bool]) -> GradientTransform:
    """Gates each member on `mask` (`(k,)` bool) and on its gradients being finite.

    A member whose gradients are not all finite takes no step when `skip_nonfinite` is set,
    or when its optimizer is a `LossScaleOptimizer` (`scaled[j]`), which skips such steps
    itself; otherwise the step is applied, as plain Keras applies it. Sets `finite`,
    `active` and `updated`.
    """
    scaling = np.asarray(scaled, dtype="bool")

    def transform(step: GradientStep) -> GradientStep:
        if skip_nonfinite or scaling.any():
            finite = _all_finite(step.grads)
        else:
            # Every step is applied, so no member is reported as skipping one (`nonfinite`),
            # and the gradients need no pass to check them.
            finite = ops.ones((len(scaling),), dtype="bool")
        applies = finite
        if not skip_nonfinite and scaling.any():
            applies = ops.logical_or(finite, ops.convert_to_tensor(~scaling))
        active = ops.logical_and(mask, applies)
        return dataclasses.replace(step, finite=finite, active=active, updated=active)

    return transform


def multi_steps(
    periods: Sequence[int], iterations: Any, accumulators: Sequence[Any] | None
) -> GradientTransform:
    """Gradient accumulation (Keras's `gradient_accumulation_steps`, optax's `MultiSteps`).

    Member `j` with period `periods[j] > 1` adds its gradients to `accumulators` (one
    variable per gradient) for `periods[j] - 1` of its steps, counted by `iterations[j]`,
    and takes a step with the mean of the `periods[j]` gradients on the last one, resetting
    them. Sets `updated` to the members that take a step, and adds the accumulators' new
    values to `updates`.
    """

    def transform(step: GradientStep) -> GradientStep:
        if all(p <= 1 for p in periods):
            return step
        assert accumulators is not None, "a member accumulates: its accumulators are made"
        period = ops.convert_to_tensor(np.asarray(periods, "int32"))
        is_update = ops.equal((iterations + 1) % period, 0)
        updated = ops.logical_and(step.active, is_update)
        accumulate = ops.logical_and(step.active, ops.logical_not(is_update))
        accumulating = np.asarray(periods) > 1
        divide = np.asarray(periods, "float32")
        grads, updates = [], []
        for g, variable in zip(step.grads, accumulators):
            rank = len(g.shape)
            acc = ops.convert_to_tensor(variable)
            mean = (g + acc) / per_member(divide, rank, g.dtype)
            grads.append(ops.where(per_member(accumulating, rank, "bool"), mean, g))
            new_acc = ops.where(
                member_axis(accumulate, rank),
                acc + g,
                ops.where(member_axis(updated, rank), ops.zeros_like(acc), acc),
            )
            updates.append((variable, new_acc))
        return dataclasses.replace(
            step, grads=grads, updated=updated, updates=(*step.updates, *updates)
        )

    return transform


def clip(
    clipnorm: Sequence[float | None],
    global_clipnorm: Sequence[float | None],
    clipvalue: Sequence[float | None],
) -> GradientTransform:
    """Each member's gradient clipping, as Keras's: per-variable norm, global norm, value.

    Each argument holds one limit per member, `None` where the member does not clip so.
    """
    k = len(clipnorm)

    def member_sums(g):
        return ops.sum(ops.square(g), axis=tuple(range(1, len(g.shape))))

    def by_norm(grads):
        use = np.asarray([c is not None for c in clipnorm])
        limits = [c if c is not None else 1.0 for c in clipnorm]
        clipped = []
        for g in grads:
            rank = len(g.shape)
            l2sum = ops.reshape(member_sums(g), (k,) + (1,) * (rank - 1))
            safe = ops.where(l2sum > 0, l2sum, ops.ones_like(l2sum))
            l2norm = ops.where(l2sum > 0, ops.sqrt(safe), l2sum)
            limit = per_member(limits, rank, g.dtype)
            c = (g * limit) / ops.maximum(l2norm, limit)
            clipped.append(ops.where(per_member(use, rank, "bool"), c, g))
        return clipped

    def by_global_norm(grads):
        use = [c is not None for c in global_clipnorm]
        limit = np.asarray([c if c is not None else 1.0 for c in global_clipnorm])
        norm = ops.sqrt(sum(member_sums(g) for g in grads))
        limit = ops.convert_to_tensor(limit.astype("float32"))
        scale = limit * ops.minimum(1.0 / norm, 1.0 / limit) + (norm - norm)
        scale = ops.where(ops.convert_to_tensor(np.asarray(use)), scale, ops.ones_like(scale))
        return [g * ops.reshape(scale, (k,) + (1,) * (len(g.shape) - 1)) for g in grads]

    def by_value(grads):
        values = [c if c is not None else np.inf for c in clipvalue]
        return [
            ops.minimum(
                ops.maximum(g, -per_member(values, len(g.shape), g.dtype)),
                per_member(values, len(g.shape), g.dtype),
            )
            for g in grads
        ]

    def transform(step: GradientStep) -> GradientStep:
        grads = step.grads
        for limits, clipper in (
            (clipnorm, by_norm),
            (global_clipnorm, by_global_norm),
            (clipvalue, by_value),
        ):
            if any(c is not None for c in limits):
                grads = clipper(grads)
        return dataclasses.replace(step, grads=grads)

    return transform


def dynamic_loss_scale(
    scale: Any,
    counter: Any,
    finite: Any,
    growth_steps: Sequence[int],
    trained: Any,
    scale_grad: Any = None,
) -> tuple[Any, Any]:
    """Each member's dynamic loss scale after a step, as Keras's `LossScaleOptimizer`'s.

    A finite step counts towards growth, and the `growth_steps[j]`-th in a row doubles the
    scale; a non-finite one halves it and restarts the count. Members not `trained` (no
    `LossScaleOptimizer`, or whose loss, the gradient `scale_grad` of the scale, is not
    finite: they took no step) keep theirs.

    Args:
        scale: `(N,)` float, the scales. Defaults to none (required).
        counter: `(N,)` int32, the finite steps in a row. Defaults to none (required).
        finite: `(N,)` bool, whether each member's gradients were finite. Defaults to none
            (required).
        growth_steps: each member's `dynamic_growth_steps`. Defaults to none (required).
        trained: `(N,)` bool, the members with a dynamic scale. Defaults to none
            (required).
        scale_grad: `(N,)`, the gradient of the loss with respect to the scales. Defaults
            to `None`.

    Returns:
        `(new scale, new counter)`.
    """
    if scale_grad is not None:
        trained = ops.logical_and(trained, ops.isfinite(ops.convert_to_tensor(scale_grad)))
    grow = ops.equal(counter, ops.convert_to_tensor(np.asarray(growth_steps, "int32")) - 1)
    new_scale = ops.where(finite, ops.where(grow, scale * 2.0, scale), scale * 0.5)
    new_counter = ops.where(finite, ops.where(grow, 0, counter + 1), 0)
    return ops.where(trained, new_scale, scale), ops.where(trained, new_counter, counter)


@dataclasses.dataclass(frozen=True)
class SlotHyperparameters:
    """A slot program's optimizer choices, read from variables at each step.

    In a program whose slots take other trials (`load_member`), a member's optimizer family
    and every float hyperparameter are data: each family of the program has a run over the
    whole group (its rule computed for every member, `families` selecting whose result is
    kept), and its hyperparameters are `(k,)` tensors read from the optimizer's variables.

    Attributes:
        run_hypers: each run's hyperparameters as Python values (a stand-in for members of
            other families), to name its slots and state.
        hypers: each run's `{name: (k,) tensor}`.
        families: each run's `(k,)` bool tensor, the members of its family.
        weight_decay: `(k,)` decoupled weight decays (0 where none), or `None` when the
            program applies none.
    """

    run_hypers: list
    hypers: list
    families: list
    weight_decay: Any


class MemberHyperparameters:
    """A group's learning rates, hyperparameters and step counts as per-member tensors.

    As optax's `inject_hyperparams`: the values are data, not constants of the rule, so
    members with different rates share one update. Each tensor is made once per variable
    rank and dtype (tracing cost grows with the operations made).

    Args:
        group_runs: the group's runs `(rule, a, b)`. Defaults to none (required).
        hypers: each member's hyperparameters (`MemberSettings.hyper`), in slice order.
            Defaults to none (required).
        rates: `(k,)` learning rates. Defaults to none (required).
        steps: `(k,)` float step counts, from 1. Defaults to none (required).
        weight_decays: each member's weight decay, `None` where it has none. Defaults to
            none (required).
        data: a slot program's choices as data (`SlotHyperparameters`), whose runs each
            cover the group. Defaults to `None` (constants).
    """

    def __init__(
        self,
        group_runs: Sequence[tuple[Any, int, int]],
        hypers: Sequence[dict],
        rates: Any,
        steps: Any,
        weight_decays: Sequence[float | None],
        data: SlotHyperparameters | None = None,
    ) -> None:
        self.runs = list(group_runs)
        self.hypers = list(hypers)
        self.rates = rates
        self.steps = steps
        self.weight_decays = list(weight_decays)
        self.data = data
        self.k = len(self.hypers)
        self._cache: dict = {}

    def once(self, make: Callable[..., Any], *args: Any) -> Any:
        """`make(*args)`, made once for this group's step."""
        key = (make, *args)
        if key not in self._cache:
            self._cache[key] = make(*args)
        return self._cache[key]

    def part(self, tensor: Any, a: int, b: int) -> Any:
        """Members `a:b` of `tensor`, or `tensor` itself when that is all of them."""
        return tensor if (a, b) == (0, self.k) else tensor[a:b]

    def run_hypers(self, r: int) -> list[dict]:
        """The hyperparameters of run `r`'s members."""
        if self.data is not None:
            return self.data.run_hypers[r]
        _, a, b = self.runs[r]
        return self.hypers[a:b]

    @property
    def decays(self) -> bool:
        """Whether the step applies weight decay."""
        if self.data is not None:
            return self.data.weight_decay is not None
        return any(w is not None for w in self.weight_decays)

    def family(self, r: int, rank: int) -> Any:
        """Run `r`'s members (a slot program's), `(k, 1, ...)` bool."""
        return self.once(self._family, r, rank)

    def learning_rate(self, rank: int, dtype: Any) -> Any:
        """The rates, `(k, 1, ...)`."""
        return self.once(self._learning_rate, rank, dtype)

    def weight_decay(self, rank: int, dtype: Any) -> Any:
        """The weight decays (0 where none), `(k, 1, ...)`."""
        return self.once(self._weight_decay, rank, dtype)

    def for_run(self, r: int, rank: int, dtype: Any) -> dict:
        """Run `r`'s `hyper` (with its `step_terms`), `lr` and `step`, `(m, 1, ...)` each."""
        return self.once(self._for_run, r, rank, dtype)

    def _learning_rate(self, rank, dtype):
        return member_axis(self.rates, rank, dtype)

    def _family(self, r, rank):
        return member_axis(self.data.families[r], rank)

    def _weight_decay(self, rank, dtype):
        if self.data is not None:
            return member_axis(self.data.weight_decay, rank, dtype)
        return per_member([w or 0.0 for w in self.weight_decays], rank, dtype)

    def _for_run(self, r, rank, dtype):
        rule, a, b = self.runs[r]
        if self.data is not None:
            values = self.data.hypers[r].items()
            hyper = {name: member_axis(value, rank, dtype) for name, value in values}
        else:
            h = self.run_hypers(r)
            hyper = {name: per_member([x[name] for x in h], rank, dtype) for name in h[0]}
        lr = self.part(self.learning_rate(rank, dtype), a, b)
        step = member_axis(self.part(self.steps, a, b), rank, dtype)
        return {"hyper": {**hyper, **rule.step_terms(hyper, lr, step)}, "lr": lr, "step": step}


def advance_rule_states(
    hyper: MemberHyperparameters, states: dict, take: np.ndarray, whole: Any
) -> tuple[list[dict], dict]:
    """Each run's per-member scalar state for this step (`rule.advance`, e.g. Nadam's).

    Args:
        hyper: the group's `MemberHyperparameters`. Defaults to none (required).
        states: `{name: (N,) tensor}`, every member's state before the step. Defaults to
            none (required).
        take: the group's member ids, as int32. Defaults to none (required).
        whole: `pick(vector)`, the group's members of an `(N,)` vector. Defaults to none
            (required).

    Returns:
        `(run_states, advanced)`: per run `{name: (m,) tensor}`, and `{name: (k,) tensor}`
        for the group.
    """
    run_states: list[dict[str, Any]] = []
    advanced: dict[str, Any] = {}
    for r, (rule, a, b) in enumerate(hyper.runs):
        h = hyper.run_hypers(r)
        names = list(rule.initial_state(h))
        if not names:
            run_states.append({})
            continue
        if hyper.data is not None:
            hyper_1d = hyper.data.hypers[r]
        else:
            hyper_1d = {
                name: ops.convert_to_tensor(np.asarray([x[name] for x in h], "float32"))
                for name in h[0]
            }
        current = {name: ops.take(states[name], take[a:b], axis=0) for name in names}
        state = rule.advance(current, hyper_1d, hyper.part(hyper.steps, a, b))
        run_states.append(state)
        for name, value in state.items():
            previous = advanced.get(name, whole(states[name]))
            if hyper.data is not None:
                advanced[name] = ops.where(hyper.data.families[r], value, previous)
            else:
                advanced[name] = ops.concatenate([previous[:a], value, previous[b:]], axis=0)
    return run_states, advanced


def decay(value: Any, hyper: MemberHyperparameters) -> Any:
    """Decoupled weight decay of a stacked `value`, each member at its own rate and decay."""
    if not hyper.decays:
        return value
    rank, dtype = len(value.shape), value.dtype
    return value - value * hyper.weight_decay(rank, dtype) * hyper.learning_rate(rank, dtype)


def apply_rule(
    gradient: Any,
    value: Any,
    slots: dict,
    hyper: MemberHyperparameters,
    run_states: Sequence[dict],
) -> tuple[Any, list[dict]]:
    """Each run's rule applied to its members' slices of one variable.

    Args:
        gradient: the `(k, ...)` gradient. Defaults to none (required).
        value: the `(k, ...)` variable's value (decayed). Defaults to none (required).
        slots: `{(run, slot name): (m, ...) tensor}`, the slots' old values. Defaults to
            none (required).
        hyper: the group's `MemberHyperparameters`. Defaults to none (required).
        run_states: each run's per-member state (`advance_rule_states`). Defaults to none
            (required).

    In a slot program (`hyper.data`) every run covers the group: each member keeps its own
    family's new value (the other runs' slots of a member are not read, and start afresh
    when a trial of their family is loaded).

    Returns:
        `(new value, [{slot name: new value}] per run)`.
    """
    rank, dtype = len(value.shape), value.dtype
    pieces, new_slots = [], []
    if hyper.data is not None:
        parts = [(gradient, value)] * len(hyper.runs)
    else:
        parts = list(zip(run_parts(gradient, hyper.runs), run_parts(value, hyper.runs)))
    for r, (g, v) in enumerate(parts):
        rule = hyper.runs[r][0]
        run = hyper.for_run(r, rank, dtype)
        names = [name for run_index, name in slots if run_index == r]
        state = {name: member_axis(s, rank, dtype) for name, s in run_states[r].items()}
        new_value, run_slots = rule.update(
            g,
            v,
            {name: slots[(r, name)] for name in names},
            run["hyper"],
            run["lr"],
            run["step"],
            state,
        )
        pieces.append(new_value)
        new_slots.append({name: run_slots[name] for name in names})
    if len(pieces) == 1:
        return pieces[0], new_slots
    if hyper.data is None:
        return ops.concatenate(pieces, axis=0), new_slots
    new = pieces[0]
    for r in range(1, len(pieces)):
        new = ops.where(hyper.family(r, rank), pieces[r], new)
    return new, new_slots


def keep_unchanged(kept: Sequence[tuple], updated: Any) -> list[tuple[Any, Any]]:
    """`[(variable, value)]`: each new value, or the old one for members not updated.

    `kept` holds `(variable, new, old, (a, b))`: `new` and `old` hold the slices of members
    `a:b` of the group, `updated` (`(k,)` bool) says which members take the new value. A
    select is a pass over the weights and the optimizer slots; TensorFlow on a CPU fuses no
    element-wise operations, so there the selects run only in steps where some member is
    not updated (one `tf.cond` for the group). Elsewhere they stay in the update: XLA (and
    JAX) fuse them into it, and on an accelerator a branch on a device value would stall
    the device.
    """
    if not kept:
        return []
    k = updated.shape[0]

    def selected():
        keeps = {}
        values = []
        for _, new, old, (a, b) in kept:
            key = (a, b, len(new.shape))
            if key not in keeps:
                part = updated if (a, b) == (0, k) else updated[a:b]
                keeps[key] = member_axis(part, len(new.shape))
            values.append(ops.where(keeps[key], new, old))
        return values

    if BACKEND.fuses_elementwise():
        values = selected()
    else:
        import tensorflow as tf

        news = [new for _, new, _, _ in kept]
        values = tf.cond(tf.reduce_all(updated), lambda: news, selected)
    return [(variable, value) for (variable, _, _, _), value in zip(kept, values)]
