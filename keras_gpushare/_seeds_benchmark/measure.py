"""How `keras-gpushare bench` takes its numbers: every run in a fresh process, repeated in turn.

Each run (a method at a member count) trains in a fresh process. Its steady rate is the median
of the epochs after `warmup` (tracing and XLA compilation happen in epoch 0, and TensorFlow's
first step of epoch 1 can stall for seconds), and the whole set of runs is repeated `repeats`
times in turn (round-robin, the order rotated each time), so that every method meets the same
moments of a shared machine. The summary gives, per run, the median over the repeats and their
range.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import multiprocessing as mp
import os
import statistics
from collections.abc import Callable
from typing import Any

from keras_gpushare._seeds_benchmark import workload
from keras_gpushare._seeds_benchmark.config import BenchConfig

logger = logging.getLogger(__name__)

Runner = Callable[[dict[str, Any]], dict[str, Any]]
Run = tuple[str, int, Runner, dict[str, Any]]
"""`(label, members, runner, runner config)`; the runner is a module-level function, so that
a fresh process can import it."""

Row = tuple[str, int, dict[str, Any]]
"""`(label, members, summary)`: one line of the report."""

_RUNNERS = {
    "sequential": workload.run_sequential,
    "pool": workload.run_pool,
    "pack-graph": workload.run_pack,
    "pack-fused": workload.run_pack,
}


def plan_runs(config: BenchConfig) -> list[Run]:
    """The runs of `config`: every method at every member count, in that order."""
    runs: list[Run] = []
    for n in config.members:
        base = run_config(config, n)
        for method in config.methods:
            runner = _RUNNERS[method]
            if method == "pool":
                for processes in sorted({min(2, n), n}):
                    runs.append((f"pool({processes})", n, runner, {**base, "processes": processes}))
            elif method.startswith("pack-"):
                runs.append((method, n, runner, {**base, "fuse": method == "pack-fused"}))
            else:
                runs.append((method, n, runner, base))
    return runs


def run_config(config: BenchConfig, n: int) -> dict[str, Any]:
    """What every runner reads: data size, epochs, warm-up, threads and the `n` members'
    specs."""
    return {
        "samples": config.samples,
        "epochs": config.epochs,
        "warmup": config.warmup,
        "threads": config.threads,
        "widths": config.widths(n),
    }


def measure(runs: list[Run], repeats: int) -> list[Row]:
    """Runs every run `repeats` times in turn, each in a fresh process: one row per run.

    A summary holds the medians over the repeats (`steady_rate`, `wall_s`), the range of the
    repeats' steady rates (`rate_min`, `rate_max`), the largest `peak_rss_mib` and each
    repeat's own figures with the load average when it started (`repeats`); a run that failed
    in every repeat has `error`.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    measured: dict[int, list[dict[str, Any]]] = {k: [] for k in range(len(runs))}
    for repeat, k in interleaved(len(runs), repeats):
        label, n, runner, run_config = runs[k]
        logger.info("bench: %s with %d members (repeat %d)", label, n, repeat + 1)
        load = _load_now()
        measured[k].append({**_run_isolated(runner, run_config), "load": load})
    return [(label, n, summarize(measured[k])) for k, (label, n, _, _) in enumerate(runs)]


def _run_isolated(runner: Runner, config: dict[str, Any]) -> dict[str, Any]:
    """Runs one measurement in a fresh process, so memory and warm-up are its own."""
    context = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as executor:
        try:
            return executor.submit(runner, config).result()
        except Exception as e:  # a method that cannot run here is reported, not fatal
            return {"error": f"{type(e).__name__}: {e}"}


def interleaved(runs: int, repeats: int) -> list[tuple[int, int]]:
    """The order of `(repeat, run)`: every run once per repeat, the order rotated by one
    each repeat, so that no method always comes first (after a cool machine) or last."""
    order = []
    for repeat in range(repeats):
        shift = repeat % runs if runs else 0
        order += [(repeat, k) for k in list(range(shift, runs)) + list(range(shift))]
    return order


def summarize(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and range over the repeats of one run; failed repeats are left out."""
    good = [r for r in repeats if "error" not in r]
    if not good:
        return {"error": repeats[-1]["error"], "repeats": repeats}
    rates = [r["steady_rate"] for r in good]
    summary = {
        "steady_rate": float(statistics.median(rates)),
        "rate_min": min(rates),
        "rate_max": max(rates),
        "wall_s": float(statistics.median(r["wall_s"] for r in good)),
        "cpu_rate": float(statistics.median(r.get("cpu_rate", math.nan) for r in good)),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in good),
        "repeats": repeats,
    }
    notes = sorted({r["note"] for r in good if r.get("note")})
    failed = len(repeats) - len(good)
    if failed:
        notes.append(f"{failed} of {len(repeats)} repeats failed")
    if notes:
        summary["note"] = "; ".join(notes)
    return summary


def _load_now() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not on every platform
        return float("nan")
