"""`ModelPack.summary()` and `count_params()`: the members as N separate models show them.

Keras's `summary()` of a pack would list its one tracked layer (the fused model, named after
member 0) with the parameters of the stacked weights, padding included, and
`count_params()` would count them too. A user compares the pack with the N models they
built: `pack_summary` prints one row per member (its class, where it trains, its output
shape, its own parameter count, its optimizer and its status) and, with
`expand_nested=True`, each member's own Keras summary after it. `member_params` counts
every member's own weights once (a layer two members share is counted once, as in one
model holding both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from keras_gpushare import _upstream
from keras_gpushare.pack.engines.base import Engine


def member_params(members: Sequence[keras.Model], trainable: bool | None = None) -> int:
    """The members' own parameters, each weight counted once.

    Args:
        members: the member models.
        trainable: count only trainable (`True`) or non-trainable (`False`) weights;
            `None` counts all.
    """
    seen: dict[int, Any] = {}
    for member in members:
        weights = {
            None: member.weights,
            True: member.trainable_weights,
            False: member.non_trainable_weights,
        }[trainable]
        for variable in weights:
            seen.setdefault(id(variable), variable)
    return int(sum(np.prod(v.shape) for v in seen.values()))


def member_places(engines: Sequence[Engine], n_members: int) -> list[str]:
    """Where each member trains, as `summary` shows it: its engine's description, the
    engine numbered among the pack's engines of its kind."""
    places = [""] * n_members
    for engine in engines:
        same_kind = [e for e in engines if type(e) is type(engine)]
        for i in engine.member_ids:
            places[i] = engine.describe(same_kind.index(engine))
    return places


def _output_shape(member: keras.Model) -> str:
    try:
        return str(member.output_shape)
    except (AttributeError, ValueError):
        return "?"


def _optimizer(member: keras.Model) -> str:
    optimizer = getattr(member, "optimizer", None)
    if optimizer is None:
        return "-"
    rate = _upstream.raw_learning_rate(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return f"{type(optimizer).__name__} ({type(rate).__name__})"
    return f"{type(optimizer).__name__} (lr {float(keras.ops.convert_to_numpy(rate)):.3g})"


def pack_summary(
    name: str,
    members: Sequence[keras.Model],
    places: Sequence[str],
    statuses: Sequence[str],
    stored: int,
    print_fn: Callable[..., Any] | None = None,
    expand_nested: bool = False,
    **member_kwargs: Any,
) -> None:
    """Prints a pack's summary (see the module docstring).

    Args:
        name: the pack's name.
        members: the member models.
        places: where each member trains (`"fused group 0"`, `"graph engine"`).
        statuses: each member's status (`ModelPack.status`).
        stored: the trainable parameters the pack's engines store (padding included).
        print_fn: called with the summary's text; prints as Keras does by default.
        expand_nested: also print each member's own `summary()`.
        **member_kwargs: passed to each member's `summary()` (`line_length`,
            `show_trainable`, ...).
    """
    header = ("member", "model", "trains on", "output shape", "params", "optimizer", "status")
    rows = [
        (
            f"m{i}",
            f"{member.name} ({type(member).__name__})",
            places[i],
            _output_shape(member),
            f"{member.count_params():,}" if member.built else "unbuilt",
            _optimizer(member),
            statuses[i],
        )
        for i, member in enumerate(members)
    ]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()

    rule = "-" * len(line(header))
    total = member_params(members)
    trainable = member_params(members, trainable=True)
    text = [
        f'Pack: "{name}" ({len(members)} members)',
        rule,
        line(header),
        rule,
        *(line(row) for row in rows),
        rule,
        f" Total params: {total:,} (the members' own)",
        f" Trainable params: {trainable:,}",
        f" Non-trainable params: {total - trainable:,}",
    ]
    if stored != trainable:
        text.append(f" Trainable params the engines store: {stored:,} (members padded to fuse)")
    output = print_fn or _upstream.print_msg
    output("\n".join(text))
    if expand_nested:
        for i, member in enumerate(members):
            output(f"\nm{i}:")
            member.summary(print_fn=print_fn, expand_nested=True, **member_kwargs)
