"""Programs: the pack's one entry for a search's executor (`keras_gpushare.tuner`).

A program is a compiled `ModelPack` with one slot per model: trials load into its slots,
train and free them. This module opens one (`open_program`: settings as constants, or held
as data so that a freed slot takes another trial's learning rate, activation and optimizer
family with no new trace), tells its FLOPs and the share of them that is padding
(`program_flops`, `own_flops`), whether a model fuses (`fuse_problem`), turns the XLA
update on (`fuse_update`), and gives a member's figures and whether a build reads a batch
(`member_logs`, `needs_a_batch`): the executor imports nothing else of the pack.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from keras_gpushare.pack._loop._fit_args import needs_a_batch
from keras_gpushare.pack._loop._member_callbacks import member_logs
from keras_gpushare.pack.fusion import cost
from keras_gpushare.pack.fusion.report import inspect_members
from keras_gpushare.pack.model import ModelPack
from keras_gpushare.pack.planner import EnginePlan

__all__ = [
    "can_fuse_update",
    "computed_flops",
    "fuse_problem",
    "fuse_update",
    "member_logs",
    "needs_a_batch",
    "open_program",
    "own_flops",
    "program_flops",
]


def open_program(
    models: Sequence[keras.Model], fuse: str | bool, settings_as_data: bool, dealt: bool
) -> ModelPack:
    """An uncompiled program of `models`, one slot each.

    Args:
        models: the slots' first occupants (trials' models, or probe builds).
        fuse: `ModelPack`'s `fuse` argument.
        settings_as_data: whether each slot's settings (learning rate, activation,
            optimizer family) are held as data, so that a freed slot takes another
            trial's with no new trace (`ModelPack.load_member`); constants else.
        dealt: whether each slot trains on its own rows of every batch (the executor
            deals each slot its own trial's data order): `data="shard"`, fused.
    """
    # on_nan="ignore": a diverging trial trains on NaN as in plain `fit`, so KerasTuner's
    # scoring (best finite epoch, or INVALID) sees the same history.
    options: dict = {"fuse": fuse, "on_nan": "ignore", "_slot_values": settings_as_data}
    if dealt:
        options.update(data="shard", _fused_shard=True)
    return ModelPack(list(models), **options)


def own_flops(model: keras.Model) -> float | None:
    """`model`'s FLOPs a sample, as the planner's cost model counts them for one member
    trained alone; None when it does not fuse (no estimate)."""
    _, plan = inspect_members([model])
    return None if plan is None else cost.GroupCosts(plan, batch=1).flops([0])[1]


def computed_flops(plan: EnginePlan, members: list) -> float | None:
    """The FLOPs a sample a step of a pack of engine plan `plan` computes: each fused group
    padded to its widest member (in a pack whose settings are held as data, every slot
    computes every layer), the graph engine's members at their own (`members`: the models
    the pack was built from); None when one of those does not fuse (no estimate)."""
    total = 0.0
    for group, fusion_plan in zip(plan.groups, plan.fusion_plans):
        costs = cost.GroupCosts(fusion_plan, batch=1)
        if plan.settings.held:
            for call in costs.calls:
                call.present_only = False
        total += costs.flops(range(len(group)))[0]
    for i in plan.graph:
        own = own_flops(members[i])
        if own is None:
            return None
        total += own
    return total


def program_flops(program: ModelPack, models: Sequence[keras.Model]) -> float | None:
    """The FLOPs a sample a step of `program` (opened from `models`) computes; None when
    one of them does not fuse (no estimate). See `computed_flops`."""
    return computed_flops(program.engine_plan, list(models))


def fuse_problem(model: keras.Model) -> str | None:
    """Why `model` cannot be a fused member of a program (its layers that have no fused
    form, say), or `None` when it can."""
    report, plan = inspect_members([model])
    if plan is not None and report.fusable:
        return None
    reasons = [*report.problems]
    reasons += [f"layer `{v.name}` ({v.type}): {v.reason}" for v in report.layers if v.reason]
    return "; ".join(reasons) or "it does not fuse"


def can_fuse_update(program: ModelPack) -> bool:
    """Whether compiling `program`'s optimizer update with XLA (`fuse_update`) changes
    anything: a vectorized optimizer that can, in a step not compiled with XLA whole."""
    optimizer = program.optimizer
    return bool(getattr(optimizer, "can_fuse_update", False)) and not program.jit_compile


def fuse_update(program: ModelPack, on: bool) -> None:
    """Compiles `program`'s optimizer update with XLA (`on`), or not; before its first
    step is traced. See `VectorizedOptimizer.fuse_update`."""
    program.optimizer.fuse_update = on
