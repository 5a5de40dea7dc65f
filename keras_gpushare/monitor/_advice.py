"""The train-end advice: how big a ModelPack would fill the GPU this run left idle."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

_TARGET_UTIL = 90.0  # % busy a pack should aim at; NVML's duty cycle saturates near 100
_MEMORY_HEADROOM = 0.9  # share of the memory a pack may take
_MAX_MEMBERS = 64


def advice_spec(devices: Sequence[Any]) -> list[tuple[str, str, str]]:
    """Whole-fit figures the advice needs, in `Sampler.take` spec form."""
    spec = []
    for device in devices:
        g = f"gpu{device.key}"
        spec += [
            (f"{g}_util", f"{g}_util", "mean"),
            (f"{g}_util_max", f"{g}_util", "max"),
            (f"{g}_mem_free_mib", f"{g}_mem_free_mib", "min"),
        ]
    spec += [("proc_gpu_mem_mib", "proc_gpu_mem_mib", "max"), ("cpu_util", "cpu_util", "mean")]
    return spec


def advice_text(
    devices: Sequence[Any],
    figures: dict[str, float],
    footprint_mib: float,
    worker: str | None = None,
) -> str:
    """One line: mean utilization per GPU and the suggested ModelPack size.

    Args:
        devices: the monitored devices (with `.key`).
        figures: whole-fit figures from `advice_spec`.
        footprint_mib: memory one model needs (framework peak), NaN when unknown; NVML's
            memory of this process stands in for it then.
        worker: the worker's name (`"worker1"`) when training runs on several, else `None`.
    """
    who = f"UtilizationLogger ({worker})" if worker else "UtilizationLogger"
    held = figures.get("proc_gpu_mem_mib", math.nan)
    per_member = footprint_mib if _known(footprint_mib) and footprint_mib > 0 else held
    parts = []
    for device in devices:
        g = f"gpu{device.key}"
        util = figures.get(f"{g}_util", math.nan)
        if not _known(util):
            parts.append(f"GPU {device.key}: utilization not available (MIG or no samples)")
            continue
        free = figures.get(f"{g}_mem_free_mib", math.nan)
        text = f"GPU {device.key} busy {util:.0f}% on average"
        if _known(free):
            text += f" ({free / 1024:.1f} GiB free at least)"
        by_util = max(1, min(_MAX_MEMBERS, round(_TARGET_UTIL / max(util, 1.0))))
        by_memory = None
        if _known(free) and _known(per_member) and per_member > 0:
            # Memory this process holds is memory a pack can reuse (TensorFlow reserves
            # nearly the whole GPU up front, so "free" alone would say no room at all).
            reusable = free + (held if _known(held) else 0.0)
            by_memory = max(1, math.floor(_MEMORY_HEADROOM * reusable / per_member))
        members = by_util if by_memory is None else min(by_util, by_memory)
        if members > 1:
            text += f": a ModelPack of about {members} members would fill it"
            if by_memory is not None and by_memory < by_util:
                text += " (memory is the limit)"
        elif by_memory is not None and by_memory < by_util:
            text += ": memory is the limit, a ModelPack would not fit"
        else:
            text += ": already busy, a ModelPack would not add much"
        parts.append(text)
    if not parts:
        cpu = figures.get("cpu_util", math.nan)
        cpu_text = f" (host CPU busy {cpu:.0f}% on average)" if _known(cpu) else ""
        return f"{who}: no GPU figures, so no ModelPack advice{cpu_text}."
    return f"{who}: " + "; ".join(parts) + "."


def _known(value: float) -> bool:
    return value is not None and not math.isnan(value)
