"""The pack's logs: `m{i}_<key>` for every member and `loss`, backend-neutral.

Inside the compiled step the logs stay stacked: one `(k,)` vector per engine and figure
(`step_logs`), so the step holds no operation per member for them (on a GPU, no kernel per
member and figure). Keras's loop reads the logs only where a call of the step returns, and
there `expanding` turns the vectors into the `m{i}_<key>` figures callbacks, `History` and
the progress bar see, reading each vector once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from keras import ops

from keras_gpushare.pack.engines.base import GroupFigures

# Keys of the step's own logs: a group's stacked figure, a member's own figure.
_STACKED = "_kg_stacked"
_OWN = "_kg_own"


def step_logs(groups: Sequence[tuple[Sequence[int], GroupFigures]]) -> dict:
    """`loss`, the members' mean loss, then each group's figures, stacked.

    `groups` holds each engine's `member_ids` and `GroupFigures`. A member that ran no step
    since the metrics were last reset (frozen or stopped before this epoch) logs NaN rather
    than a stale or zero figure, and is left out of `loss`. `expanded` turns the result into
    the pack's logs.
    """
    nan = ops.convert_to_tensor(float("nan"))
    stacked: dict = {}
    own: dict = {}
    totals, counts = [], []
    for g, (member_ids, figures) in enumerate(groups):
        ran = figures.ran
        losses = ops.cast(figures.losses, "float32")
        stacked[f"{_STACKED}/{g}/loss"] = ops.where(ran, losses, nan)
        for name, values in figures.shared.items():
            stacked[f"{_STACKED}/{g}/{name}"] = ops.where(ran, ops.cast(values, "float32"), nan)
        if any(figures.own):
            ran_each = ops.unstack(ran, num=len(member_ids))
            for j, i in enumerate(member_ids):
                for name, value in figures.own[j].items():
                    value = ops.where(ran_each[j], ops.cast(value, "float32"), nan)
                    own[f"{_OWN}/{i}/{name}"] = value
        totals.append(ops.sum(ops.where(ran, losses, 0.0)))
        counts.append(ops.sum(ops.cast(ran, "float32")))
    count = ops.sum(ops.stack(counts))
    total = ops.sum(ops.stack(totals))
    mean = ops.where(ops.greater(count, 0), total / ops.maximum(count, 1.0), nan)
    return {"loss": mean, **stacked, **own}


def expanded(logs: dict, member_ids: Sequence[Sequence[int]], n_members: int) -> dict:
    """The pack's logs from `step_logs`'s: `loss`, then member by member `m{i}_loss`, its
    stacked figures and its own, in that order (as `evaluate` lists them).

    Args:
        logs: what a call of the step returned.
        member_ids: each group's members, in the order `step_logs` was given them.
        n_members: the pack's member count.
    """
    per_member: list[dict] = [{} for _ in range(n_members)]
    result = {}
    for key, value in logs.items():
        if key.startswith(_STACKED + "/"):
            _, g, name = key.split("/", 2)
            values = np.reshape(ops.convert_to_numpy(value), (-1,))
            for j, i in enumerate(member_ids[int(g)]):
                per_member[i][f"m{i}_{name}"] = values[j]
        elif key.startswith(_OWN + "/"):
            _, i, name = key.split("/", 2)
            per_member[int(i)][f"m{i}_{name}"] = value
        else:
            result[key] = value
    for figures in per_member:
        result.update(figures)
    return result


def expanding(
    function: Callable[..., Any], expand: Callable[[dict], dict], stateless: bool
) -> Callable[..., Any]:
    """`function` (Keras's training or test function), returning the pack's logs.

    Args:
        function: returns `step_logs`'s logs, or `(logs, state)` when `stateless`.
        expand: turns those logs into the pack's (`expanded` with the pack's layout).
        stateless: whether `function` takes and returns the variables' state (JAX).
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        if stateless:
            logs, state = result
            return expand(logs), state
        return expand(result)

    return call
