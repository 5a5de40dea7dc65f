"""The pack's logs: `m{i}_<name>` for every member and `loss`, backend-neutral."""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import ops


def pack_logs(members: Sequence[keras.Model]) -> dict:
    """Every member's metric results, prefixed `m{i}_`, and `loss`, the members' mean loss.

    A member that ran no step since the metrics were last reset (frozen or stopped before
    this epoch) logs NaN rather than a stale or zero figure, and is left out of `loss`.
    """
    logs = {}
    losses, counted = [], []
    nan = ops.convert_to_tensor(float("nan"))
    for i, member in enumerate(members):
        ran = ops.greater(member._loss_tracker.count, 0)
        for name, value in member.get_metrics_result().items():
            logs[f"m{i}_{name}"] = ops.where(ran, ops.cast(value, "float32"), nan)
        losses.append(ops.where(ran, ops.cast(member._loss_tracker.result(), "float32"), 0.0))
        counted.append(ops.cast(ran, "float32"))
    count = ops.sum(ops.stack(counted))
    total = ops.sum(ops.stack(losses))
    mean = ops.where(ops.greater(count, 0), total / ops.maximum(count, 1.0), nan)
    return {"loss": mean, **logs}
