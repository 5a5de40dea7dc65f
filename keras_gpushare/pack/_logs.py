"""The pack's logs: `m{i}_<key>` for every member and `loss`, backend-neutral."""

from __future__ import annotations

from collections.abc import Sequence

from keras import ops

from keras_gpushare.pack.engines.base import MemberFigures


def pack_logs(figures: Sequence[MemberFigures]) -> dict:
    """`loss`, the members' mean loss, then every member's figures prefixed `m{i}_`.

    `figures[i]` is member i's. A member that ran no step since the metrics were last reset
    (frozen or stopped before this epoch) logs NaN rather than a stale or zero figure, and
    is left out of `loss`.
    """
    nan = ops.convert_to_tensor(float("nan"))
    logs, losses, counted = {}, [], []
    for i, member in enumerate(figures):
        logs[f"m{i}_loss"] = ops.where(member.ran, ops.cast(member.loss, "float32"), nan)
        for name, value in member.metrics.items():
            logs[f"m{i}_{name}"] = ops.where(member.ran, ops.cast(value, "float32"), nan)
        losses.append(ops.where(member.ran, ops.cast(member.loss, "float32"), 0.0))
        counted.append(ops.cast(member.ran, "float32"))
    count = ops.sum(ops.stack(counted))
    total = ops.sum(ops.stack(losses))
    mean = ops.where(ops.greater(count, 0), total / ops.maximum(count, 1.0), nan)
    return {"loss": mean, **logs}
