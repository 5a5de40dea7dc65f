"""Sequential fits of a few members, timed as if all had run (`--sequential-at-most`):
sequential fits cost the same per member, and this keeps N=256 runs short."""

from __future__ import annotations

from typing import Any

from keras_gpushare._seeds_benchmark.measure import Run
from keras_gpushare._seeds_benchmark.workload import run_sequential


def sample_sequential(runs: list[Run], at_most: int) -> list[Run]:
    """`runs` with each sequential run limited to its first `at_most` members."""
    return [
        (label, n, run_sampled, {**config, "run_at_most": at_most})
        if label == "sequential" and n > at_most
        else (label, n, runner, config)
        for label, n, runner, config in runs
    ]


def run_sampled(config: dict[str, Any]) -> dict[str, Any]:
    """`run_sequential` on the first `config["run_at_most"]` members, its time scaled to all."""
    widths = config["widths"]
    ran = widths[: config["run_at_most"]]
    result = run_sequential({**config, "widths": ran})
    return {
        **result,
        "wall_s": result["wall_s"] * len(widths) / len(ran),
        "note": f"{len(ran)} run, time scaled",
    }
