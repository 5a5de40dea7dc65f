"""The pack's logs: `m{i}_<key>` for every member and `loss`, backend-neutral.

Inside the compiled step the logs stay stacked: one `(k,)` vector per engine and figure
(`step_logs`), running means as their undivided sums (`StackedRatio`), and which members
ran a step where an engine says so, so the step holds no operation per member for them (on
a GPU, no kernel per member and figure), nor the pack's mean loss. Keras's loop reads the
logs only where a call of the step returns, and there `expanding` turns the vectors into
the `m{i}_<key>` figures and the mean `loss` callbacks, `History` and the progress bar see,
reading each vector once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from keras import ops

from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack.engines.base import GroupFigures, StackedRatio, host_mean

# Keys of the step's own logs: a group's stacked figure, a running mean's undivided total
# and count, a member's own figure, and which of a group's members ran a step since the
# metrics were last reset (where the group says so; else where its loss count is above 0).
_STACKED = "_kg_stacked"
_TOTAL = "_kg_total"
_COUNT = "_kg_count"
_OWN = "_kg_own"
_RAN = "_kg_ran"


def step_logs(groups: Sequence[tuple[Sequence[int], GroupFigures]]) -> dict:
    """Each group's figures, stacked, and which of its members ran a step.

    `groups` holds each engine's `member_ids` and `GroupFigures`. `expanded` turns the
    result into the pack's logs.
    """
    logs: dict = {}
    for g, (member_ids, figures) in enumerate(groups):
        if figures.ran is not None:
            logs[f"{_RAN}/{g}"] = ops.cast(figures.ran, "float32")
        for name, values in {"loss": figures.losses, **figures.shared}.items():
            if isinstance(values, StackedRatio):
                logs[f"{_TOTAL}/{g}/{name}"] = ops.cast(values.total, "float32")
                logs[f"{_COUNT}/{g}/{name}"] = ops.cast(values.count, "float32")
            else:
                logs[f"{_STACKED}/{g}/{name}"] = ops.cast(values, "float32")
        for j, i in enumerate(member_ids):
            for name, value in figures.own[j].items():
                logs[f"{_OWN}/{i}/{name}"] = ops.cast(value, "float32")
    return logs


def _vector(value: Any) -> np.ndarray:
    return np.reshape(ops.convert_to_numpy(value), (-1,))


def _ran(logs: dict, member_ids: Sequence[Sequence[int]], n_members: int) -> np.ndarray:
    """Which members ran a step since the metrics were last reset."""
    ran = np.zeros(n_members, dtype=bool)
    for g, ids in enumerate(member_ids):
        flags = logs.get(f"{_RAN}/{g}")
        if flags is None:
            flags = logs[f"{_COUNT}/{g}/loss"]
        ran[list(ids)] = _vector(flags) > 0
    return ran


def expanded(logs: dict, member_ids: Sequence[Sequence[int]], n_members: int) -> dict:
    """The pack's logs from `step_logs`'s: `loss`, the mean loss of the members that ran a
    step since the metrics were last reset, then member by member `m{i}_loss`, its stacked
    figures and its own, in that order (as `evaluate` lists them). A member that ran no
    step since then (frozen or stopped before this epoch) logs NaN rather than a stale or
    zero figure, and is left out of `loss`.

    Args:
        logs: what a call of the step returned.
        member_ids: each group's members, in the order `step_logs` was given them.
        n_members: the pack's member count.
    """
    ran = _ran(logs, member_ids, n_members)
    nan = np.float32("nan")
    per_member: list[dict] = [{} for _ in range(n_members)]
    losses = np.full(n_members, nan, dtype="float32")
    result = {"loss": nan}
    for key, value in logs.items():
        if key.startswith((_RAN + "/", _COUNT + "/")):
            continue
        if key.startswith((_STACKED + "/", _TOTAL + "/")):
            kind, g, name = key.split("/", 2)
            values = _vector(value)
            if kind == _TOTAL:
                values = host_mean(values, _vector(logs[f"{_COUNT}/{g}/{name}"]))
            for j, i in enumerate(member_ids[int(g)]):
                per_member[i][f"m{i}_{name}"] = values[j] if ran[i] else nan
            if name == "loss":
                losses[list(member_ids[int(g)])] = values
        elif key.startswith(_OWN + "/"):
            _, i, name = key.split("/", 2)
            own = np.asarray(ops.convert_to_numpy(value))
            own = own if ran[int(i)] else np.full_like(own, nan)
            per_member[int(i)][f"m{i}_{name}"] = own[()] if own.ndim == 0 else own
        else:
            result[key] = value
    if ran.any():
        result["loss"] = np.float32(np.sum(losses[ran], dtype="float32") / np.float32(ran.sum()))
    for figures in per_member:
        result.update(figures)
    return result


def expanding(function: Callable[..., Any], expand: Callable[[dict], dict]) -> Callable[..., Any]:
    """`function` (Keras's training or test function), returning the pack's logs.

    Args:
        function: returns `step_logs`'s logs, or `(logs, state)` where the backend's steps
            take and return the variables' state (JAX).
        expand: turns those logs into the pack's (`expanded` with the pack's layout).
    """
    stateless = BACKEND.stateless_steps

    def call(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        if stateless:
            logs, state = result
            return expand(logs), state
        return expand(result)

    return call
