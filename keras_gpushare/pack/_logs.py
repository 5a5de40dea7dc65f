"""The pack's logs: `m{i}_<key>` for every member and `loss`, backend-neutral."""

from __future__ import annotations

from collections.abc import Sequence

from keras import ops

from keras_gpushare.pack.engines.base import GroupFigures


def pack_logs(groups: Sequence[tuple[Sequence[int], GroupFigures]], n_members: int) -> dict:
    """`loss`, the members' mean loss, then every member's figures prefixed `m{i}_`.

    `groups` holds each engine's `member_ids` and `GroupFigures`. A member that ran no step
    since the metrics were last reset (frozen or stopped before this epoch) logs NaN rather
    than a stale or zero figure, and is left out of `loss`. Stacked figures are masked and
    split once per engine, not once per member.
    """
    nan = ops.convert_to_tensor(float("nan"))
    per_member: list = [None] * n_members
    totals, counts = [], []
    for member_ids, figures in groups:
        k = len(member_ids)
        ran = figures.ran
        losses = ops.cast(figures.losses, "float32")
        columns = {"loss": ops.unstack(ops.where(ran, losses, nan), num=k)}
        for name, values in figures.shared.items():
            columns[name] = ops.unstack(ops.where(ran, ops.cast(values, "float32"), nan), num=k)
        ran_each = ops.unstack(ran, num=k) if any(figures.own) else []
        for j, i in enumerate(member_ids):
            logs = {f"m{i}_{name}": values[j] for name, values in columns.items()}
            for name, value in figures.own[j].items():
                logs[f"m{i}_{name}"] = ops.where(ran_each[j], ops.cast(value, "float32"), nan)
            per_member[i] = logs
        totals.append(ops.sum(ops.where(ran, losses, 0.0)))
        counts.append(ops.sum(ops.cast(ran, "float32")))
    count = ops.sum(ops.stack(counts))
    total = ops.sum(ops.stack(totals))
    mean = ops.where(ops.greater(count, 0), total / ops.maximum(count, 1.0), nan)
    logs = {"loss": mean}
    for member_logs in per_member:
        logs.update(member_logs)
    return logs
