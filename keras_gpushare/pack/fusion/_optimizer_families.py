"""A slot program's optimizer choices as data: which family, its hyperparameters, decay.

A `VectorizedOptimizer` built for a program whose slots take other trials
(`settings="held"`) holds the families its members were built with (Adam and SGD, say)
and updates every member with each family's rule, keeping the result of its own; each
family's float hyperparameters and the weight decays are per-member variables (optax's
`inject_hyperparams`). What stays a constant of the compiled step is checked here before a
trial is loaded: the set of families and their slots, whether decay is applied, clipping,
gradient accumulation, loss scaling and the learning-rate schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from keras_gpushare.pack.fusion._member_settings import MemberSettings

# What a slot keeps from the member it was built with: constants of the compiled step.
_STEP_CONSTANTS = ("clip", "loss_scale_factor", "accumulation", "dynamic_scale")


def families(settings: Sequence[MemberSettings], ids: Sequence[int]) -> list:
    """The rules of members `ids`, each once, in member order."""
    rules: list = []
    for i in ids:
        rule = settings[i].rule
        if rule is not None and rule not in rules:
            rules.append(rule)
    return rules


def stand_ins(settings: Sequence[MemberSettings]) -> dict:
    """`{rule: hyperparameters}` of each family's first member: what a member of another
    family holds in that family's variables (computed for it, never kept)."""
    found: dict = {}
    for s in settings:
        if s.rule is not None:
            found.setdefault(s.rule, s.hyper)
    return found


def run_hypers(settings: Sequence[MemberSettings], ids: Sequence[int], rule: Any, stand_in: dict):
    """The hyperparameters `rule` is computed with for members `ids`."""
    return [settings[i].hyper if settings[i].rule is rule else stand_in for i in ids]


def load_problem(
    old: MemberSettings,
    new: MemberSettings,
    rules: Sequence[Any],
    slot_names: dict,
    decays: bool,
) -> str | None:
    """Why a slot built with `old` cannot take an optimizer read as `new`, or `None`.

    Args:
        old: the slot's settings now.
        new: the settings of the optimizer to load.
        rules: the families of the slot's group.
        slot_names: `{rule: set of slot names}` the program holds.
        decays: whether the program applies weight decay.
    """
    if new.rule not in rules:
        held = ", ".join(type(r).__name__.strip("_") for r in rules)
        return (
            f"its optimizer's family ({type(new.rule).__name__.strip('_')}) is not one this "
            f"program was compiled with ({held})"
        )
    missing = set(new.rule.slots([new.hyper])) - slot_names.get(new.rule, set())
    if missing:
        return (
            f"its optimizer needs the slots {sorted(missing)}, which this program's members "
            "of that family do not have"
        )
    if new.weight_decay is not None and not decays:
        return (
            f"its optimizer sets `weight_decay={new.weight_decay}`, and this program was "
            "compiled without weight decay"
        )
    for field in _STEP_CONSTANTS:
        if getattr(new, field) != getattr(old, field):
            return (
                f"its optimizer's `{field}` is {getattr(new, field)!r} where the slot's is "
                f"{getattr(old, field)!r}: a constant of the compiled step"
            )
    if _schedule_config(new.schedule) != _schedule_config(old.schedule):
        return (
            "its learning-rate schedule differs from the slot's; a schedule is a constant of "
            "the compiled step, only a fixed learning rate may differ"
        )
    return None


def _schedule_config(schedule: Any) -> Any:
    return None if schedule is None else keras.optimizers.schedules.serialize(schedule)
