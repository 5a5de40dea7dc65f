"""`keras-gpushare bench`: the seeds' workload as sequential fits, process pools and packs.

Measurement. Each run (a method at a member count) trains in a fresh process. Its steady rate
is the median of the epochs after `warmup` (tracing and XLA compilation happen in epoch 0,
and TensorFlow's first step of epoch 1 can stall for seconds), and the whole set of runs is
repeated `repeats` times in turn (round-robin, the order rotated each time), so that every
method meets the same moments of a shared machine. The report gives, per method, the median
over the repeats and their range.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import logging
import math
import multiprocessing as mp
import os
import platform
import statistics
from typing import Any

from keras_gpushare._bench import workload

logger = logging.getLogger(__name__)

METHODS = ("sequential", "pool", "pack-graph", "pack-fused", "torch-vmap")
_MIXED_WIDTHS = (16, 32, 48, 64)
ARCHITECTURES = ("same", "mixed", "varied")
_ARCHITECTURE_LINES = {
    "same": "widths 64",
    "mixed": "first hidden widths 16/32/48/64",
    "varied": "first hidden widths 16/32/48/64, 1-3 hidden layers, relu or tanh",
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run_pack_benchmark` measures.

    Args:
        members: member counts to run. Defaults to `(1, 4, 16)`.
        samples: training rows per epoch. Defaults to `25_000`.
        epochs: epochs per run, warm-up included. Defaults to `5`.
        warmup: epochs left out of the steady rate (the median of the others). Defaults to
            `2`.
        repeats: how many times every run is repeated, in turn. Defaults to `3`.
        threads: threads per process for TensorFlow's pools (0: TensorFlow's default).
            Defaults to `0`.
        torch_threads: thread counts of the torch peer, one run each (0: torch's default,
            one per core; on a shared machine its threads wait for each other at every
            operation, see docs/benchmarks.md). Defaults to `(1,)`.
        methods: methods to run, from `METHODS`. Defaults to all but the torch peer.
        architecture: `"same"` (all the seeds' 10-64-32-1 model), `"mixed"` (first
            hidden widths 16/32/48/64 in turn) or `"varied"` (those widths, 1-3 hidden
            layers and relu or tanh, in turn); the fused engine pads what differs, the
            torch peer needs one architecture and is left out. Defaults to `"same"`.
        sequential_at_most: train at most this many members sequentially and scale the
            time to all of them (sequential fits cost the same per member). Defaults to
            `None` (train them all).
    """

    members: tuple[int, ...] = (1, 4, 16)
    samples: int = 25_000
    epochs: int = 5
    methods: tuple[str, ...] = ("sequential", "pool", "pack-graph", "pack-fused")
    architecture: str = "same"
    sequential_at_most: int | None = None
    warmup: int = 2
    repeats: int = 3
    threads: int = 0
    torch_threads: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if self.epochs <= self.warmup:
            raise ValueError(
                f"Invalid value for --epochs: got {self.epochs} with {self.warmup} warm-up "
                f"epochs. Pass at least {self.warmup + 1} so that an epoch is timed."
            )

    @classmethod
    def quick(cls) -> BenchConfig:
        """A run of about a minute on two CPU cores: the `make demo` job (the seeds' model)."""
        return cls(members=(1, 4), samples=5_000, epochs=4, repeats=1, architecture="same")

    @classmethod
    def full(cls) -> BenchConfig:
        """The benchmark of `make bench` and docs/benchmarks.md."""
        return cls()

    def with_overrides(
        self,
        members: str | None = None,
        samples: int | None = None,
        epochs: int | None = None,
        methods: str | None = None,
        architecture: str | None = None,
        sequential_at_most: int | None = None,
        repeats: int | None = None,
        threads: int | None = None,
        torch_threads: str | None = None,
    ) -> BenchConfig:
        """Returns a copy with the command line's choices applied (None keeps a field)."""
        changes: dict[str, Any] = {}
        if members:
            changes["members"] = tuple(_positive_ints(members, "--members"))
        if samples is not None:
            changes["samples"] = _positive(samples, "--samples")
        if epochs is not None:
            changes["epochs"] = _positive(epochs, "--epochs")
        if methods:
            chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
            unknown = [m for m in chosen if m not in METHODS]
            if unknown:
                raise ValueError(
                    f"Invalid value for --methods: unknown {unknown}. Choose from "
                    f"{', '.join(METHODS)}."
                )
            changes["methods"] = chosen
        if architecture is not None:
            if architecture not in ARCHITECTURES:
                raise ValueError(
                    f"Invalid value for --architecture: got {architecture!r}. Expected one of "
                    f"{', '.join(ARCHITECTURES)}."
                )
            changes["architecture"] = architecture
        if sequential_at_most is not None:
            changes["sequential_at_most"] = _positive(sequential_at_most, "--sequential-at-most")
        if repeats is not None:
            changes["repeats"] = _positive(repeats, "--repeats")
        if threads is not None:
            changes["threads"] = _threads(threads, "--threads")
        if torch_threads:
            changes["torch_threads"] = tuple(
                _threads(int(v), "--torch-threads") for v in _ints(torch_threads, "--torch-threads")
            )
        return dataclasses.replace(self, **changes)

    def widths(self, n: int) -> list[Any]:
        """Each of `n` members' `build_mlp` spec (a first hidden width, or a full spec)."""
        if self.architecture == "same":
            return [64] * n
        widths = [_MIXED_WIDTHS[i % len(_MIXED_WIDTHS)] for i in range(n)]
        if self.architecture == "mixed":
            return widths
        return [[w, 1 + (i // 4) % 3, ("relu", "tanh")[(i // 2) % 2]] for i, w in enumerate(widths)]


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise ValueError(f"Invalid value for {flag}: got {value}, expected a positive integer.")
    return value


def _threads(value: int, flag: str) -> int:
    if value < 0:
        raise ValueError(
            f"Invalid value for {flag}: got {value}, expected 0 (the framework's default) or "
            "a positive number of threads."
        )
    return value


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"Invalid value for {flag}: got {text!r}, expected comma-separated integers such "
            "as 1,4,16."
        ) from None


def _positive_ints(text: str, flag: str) -> list[int]:
    return [_positive(v, flag) for v in _ints(text, flag)]


def _runs(config: BenchConfig) -> list[tuple[str, int, dict[str, Any]]]:
    runs = []
    for n in config.members:
        base = {
            "samples": config.samples,
            "epochs": config.epochs,
            "warmup": config.warmup,
            "threads": config.threads,
            "widths": config.widths(n),
        }
        for method in config.methods:
            if method == "pool":
                for processes in sorted({min(2, n), n}):
                    runs.append((f"pool({processes})", n, {**base, "processes": processes}))
            elif method == "torch-vmap" and config.architecture != "same":
                logger.info("bench: %s needs one architecture; left out of this run", method)
            elif method == "torch-vmap":
                if importlib.util.find_spec("torch") is not None:
                    for threads in config.torch_threads:
                        label = method
                        if len(config.torch_threads) > 1:
                            label += f"({threads}t)" if threads else "(auto)"
                        runs.append((label, n, {**base, "threads": threads}))
            elif method == "sequential":
                runs.append((method, n, {**base, "run_at_most": config.sequential_at_most}))
            else:
                runs.append((method, n, {**base, "fuse": method == "pack-fused"}))
    return runs


def _run_isolated(method: str, config: dict[str, Any]) -> dict[str, Any]:
    """Runs one measurement in a fresh process, so memory and warm-up are its own."""
    runner = workload.RUNNERS[method.split("(")[0]]
    context = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as executor:
        try:
            return executor.submit(runner, config).result()
        except Exception as e:  # a method that cannot run here is reported, not fatal
            return {"error": f"{type(e).__name__}: {e}"}


def run_pack_benchmark(config: BenchConfig) -> list[tuple[str, int, dict[str, Any]]]:
    """Runs every method for every member count, `config.repeats` times in turn:
    `(method, members, summary)` rows.

    A summary holds the medians over the repeats (`steady_rate`, `wall_s`), the range of the
    repeats' steady rates (`rate_min`, `rate_max`), the largest `peak_rss_mib` and each
    repeat's own figures (`repeats`); a method that failed in every repeat has `error`.
    `format_report` turns the rows into the table; `keras_gpushare._bench.plot` into a PNG.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    runs = _runs(config)
    measured: dict[int, list[dict[str, Any]]] = {k: [] for k in range(len(runs))}
    for repeat, k in interleaved(len(runs), config.repeats):
        method, n, run_config = runs[k]
        logger.info("bench: %s with %d members (repeat %d)", method, n, repeat + 1)
        load = _load_now()
        measured[k].append({**_run_isolated(method, run_config), "load": load})
    return [(method, n, summarize(measured[k])) for k, (method, n, _) in enumerate(runs)]


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


def _load(results: list[tuple[str, int, dict[str, Any]]]) -> str:
    loads = [r["load"] for _, _, s in results for r in s.get("repeats", [])]
    loads = [v for v in loads if math.isfinite(v)]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "unknown"


def _device_line() -> str:
    import keras

    backend = keras.backend.backend()
    gpus: list = []
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = [d.name for d in tf.config.list_physical_devices("GPU")]
    elif backend == "jax":
        import jax

        gpus = [d.device_kind for d in jax.devices() if d.platform == "gpu"]
    elif backend == "torch":
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    where = (
        f"{len(gpus)} GPU(s): {', '.join(sorted(set(gpus)))}"
        if gpus
        else f"CPU only (no GPU found: {backend} runs on the CPU)"
    )
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, {where}; Keras {keras.__version__} on {backend}"


def format_report(config: BenchConfig, results: list[tuple[str, int, dict[str, Any]]]) -> str:
    """The benchmark table, with ratios against sequential fits at the same member count."""
    threads = config.threads or "default"
    torch_threads = ", ".join(str(t or "default") for t in config.torch_threads)
    lines = [
        "keras-gpushare bench: the seeds' MLP (10-w-32-1, Adam, batch 32)",
        f"machine: {_device_line()}",
        f"load average (1 min) when the runs started: {_load(results)}",
        f"{config.samples} samples x {config.epochs} epochs per member; "
        f"{_ARCHITECTURE_LINES[config.architecture]}",
        f"steady: median of epochs {config.warmup + 1}-{config.epochs} of a run; median "
        f"[min-max] over {config.repeats} interleaved repeat(s); threads per process: "
        f"TensorFlow {threads}, torch {torch_threads}",
        "",
        f"{'N':>4}  {'method':<12} {'end-to-end s':>12} {'x seq':>7} "
        f"{'steady model-samples/s':>23} {'[min-max]':>21} {'x seq':>7} {'per CPU-s':>10} "
        f"{'peak RSS MiB':>13}",
    ]
    sequential = {n: r for m, n, r in results if m == "sequential" and "error" not in r}
    for method, n, r in results:
        if "error" in r:
            lines.append(f"{n:>4}  {method:<12} n/a: {r['error'][:90]}")
            continue
        base = sequential.get(n)
        wall_ratio = f"{base['wall_s'] / r['wall_s']:.2f}" if base else "-"
        rate_ratio = f"{r['steady_rate'] / base['steady_rate']:.2f}" if base else "-"
        note = f"  ({r['note']})" if r.get("note") else ""
        spread = f"[{r['rate_min']:,.0f}-{r['rate_max']:,.0f}]"
        cpu = f"{r['cpu_rate']:,.0f}" if math.isfinite(r.get("cpu_rate", math.nan)) else "-"
        lines.append(
            f"{n:>4}  {method:<12} {r['wall_s']:>12.1f} {wall_ratio:>7} "
            f"{r['steady_rate']:>23,.0f} {spread:>21} {rate_ratio:>7} {cpu:>10} "
            f"{r['peak_rss_mib']:>13,.0f}{note}"
        )
    lines.append("")
    lines.append("x seq: how many times faster than sequential fits (higher is better).")
    lines.append(
        "per CPU-s: model-samples per second of this process's CPU time (the steady epochs' "
        "median); it moves less than the wall-clock rate when other jobs share the machine."
    )
    return "\n".join(lines)
