"""Moving optimizer state between `VectorizedOptimizer` and the members' own optimizers.

A member's view (`pack.members[i]`, `pack.member(i)`) carries its optimizer's state (step
count, rate, slots, mixed-precision scale) so it saves and goes on training as a model of its
own; a member that trained before joining a pack hands its state over the other way. With
padding, a member's slot is the corner of its slice that its weight occupies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack.fusion._member_settings import inner_optimizer
from keras_gpushare.pack.fusion.model import member_part, set_member_part


def _member_variables(optimizer: Any, parts_of: dict, j: int) -> list:
    """Member `j`'s variables, in the order of the stacked ones the optimizer holds."""
    return [
        parts_of[id(v)][j]
        for v in optimizer.stacked_variables
        if id(v) in parts_of and parts_of[id(v)][j][0] is not None
    ]


def _slot_pairs(
    optimizer: Any, optimizers: Sequence, variable_map: Any, member_ids: Sequence[int]
) -> Iterator[tuple]:
    """`(row, index, stacked slot, member slot)` for every slot both sides have (a member
    optimizer not built has none)."""
    parts_of = {id(fused): parts for fused, parts in variable_map}
    for j, member_optimizer in enumerate(optimizers):
        if not member_optimizer.built:
            continue
        inner = inner_optimizer(member_optimizer)
        row, slots = optimizer.member_slots(member_ids, j)
        rule = optimizer.member_settings(member_ids[j]).rule
        for k, fused in enumerate(optimizer.stacked_variables):
            if id(fused) not in parts_of:
                continue
            variable, index = parts_of[id(fused)][j]
            if variable is None:
                continue
            position = _upstream.variable_index(inner, variable)
            for name, slot_list in rule.member_slots(inner).items():
                stacked = slots.get((k, name))
                if stacked is not None:
                    yield row, index, stacked, slot_list[position]
            accumulator = optimizer.accumulator(k)
            if accumulator is not None and inner.gradient_accumulation_steps:
                accumulated = _upstream.slot_list(inner, "accumulated_gradients")
                yield j, index, accumulator, accumulated[position]


def _checked(
    optimizer: Any, optimizers: Sequence, variable_map: Any, member_ids: Any, build: bool = True
) -> tuple:
    """The member optimizers, built on their variables when `build`, and the group's member
    ids."""
    optimizers = list(optimizers)
    member_ids = tuple(range(optimizer.n_members) if member_ids is None else member_ids)
    if len(optimizers) != len(member_ids):
        raise ValueError(
            f"Invalid value for argument `optimizers`: got {len(optimizers)} optimizers "
            f"for {len(member_ids)} members. Pass one optimizer per member."
        )
    if not optimizer.built:
        raise ValueError(
            "The vectorized optimizer is not built yet. Call "
            "`optimizer.build(fused_model.trainable_variables)` first."
        )
    parts_of = {id(fused): parts for fused, parts in variable_map}
    for j, member_optimizer in enumerate(optimizers):
        if build and not member_optimizer.built:
            member_optimizer.build([v for v, _ in _member_variables(optimizer, parts_of, j)])
    return optimizers, member_ids


def write_state_to(optimizer: Any, optimizers: Sequence, variable_map: Any, member_ids: Any):
    """See `VectorizedOptimizer.write_state_to`."""
    optimizers, member_ids = _checked(optimizer, optimizers, variable_map, member_ids)
    steps = ops.convert_to_numpy(optimizer.member_iterations)
    rates = ops.convert_to_numpy(optimizer.member_learning_rate)
    states = {name: ops.convert_to_numpy(s) for name, s in optimizer.member_states.items()}
    scale = optimizer.loss_scale_variable
    for member_optimizer, i in zip(optimizers, member_ids):
        inner = inner_optimizer(member_optimizer)
        settings = optimizer.member_settings(i)
        _upstream.iterations_variable(inner).assign(int(steps[i]))
        if settings.schedule is None:
            inner.learning_rate = float(rates[i])
        for name, read in settings.rule.member_state.items():
            read(inner).assign(states[name][i])
        if member_optimizer is not inner and scale is not None:
            member_optimizer.dynamic_scale.assign(ops.convert_to_numpy(scale)[i])
            counter = ops.convert_to_numpy(optimizer.scale_counter)[i]
            member_optimizer.step_counter.assign(int(counter))
    for row, index, stacked, member_slot in _slot_pairs(
        optimizer, optimizers, variable_map, member_ids
    ):
        member_slot.assign(member_part(ops.convert_to_numpy(stacked), row, index))


def read_state_from(optimizer: Any, optimizers: Sequence, variable_map: Any, member_ids: Any):
    """See `VectorizedOptimizer.read_state_from`.

    A member optimizer that is not built holds no state beyond its step count and rate
    (its slots would be the initial ones the stacked slots already hold), so it is read
    without being built: building N members' optimizers is most of a large pack's setup.
    """
    optimizers, member_ids = _checked(optimizer, optimizers, variable_map, member_ids, False)
    steps = ops.convert_to_numpy(optimizer.member_iterations).copy()
    rates = ops.convert_to_numpy(optimizer.member_learning_rate).copy()
    for member_optimizer, i in zip(optimizers, member_ids):
        inner = inner_optimizer(member_optimizer)
        settings = optimizer.member_settings(i)
        steps[i] = int(ops.convert_to_numpy(inner.iterations))
        if settings.schedule is None:
            rates[i] = float(ops.convert_to_numpy(inner.learning_rate))
        if not member_optimizer.built:
            continue
        for name, read in settings.rule.member_state.items():
            state = optimizer.member_states[name]
            value = ops.convert_to_numpy(state).copy()
            value[i] = float(ops.convert_to_numpy(read(inner)))
            state.assign(value)
    optimizer.member_iterations.assign(steps.astype("int32"))
    optimizer.member_learning_rate.assign(rates.astype("float32"))
    updates: dict = {}
    for row, index, stacked, member_slot in _slot_pairs(
        optimizer, optimizers, variable_map, member_ids
    ):
        value = updates.setdefault(id(stacked), (stacked, np.array(ops.convert_to_numpy(stacked))))
        set_member_part(value[1], row, index, ops.convert_to_numpy(member_slot))
    for stacked, value in updates.values():
        stacked.assign(value)
