"""`keras-gpushare bench`: the seeds' workload as sequential fits, process pools and packs."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import logging
import multiprocessing as mp
import os
import platform
from typing import Any

from keras_gpushare._bench import workload

logger = logging.getLogger(__name__)

METHODS = ("sequential", "pool", "pack-graph", "pack-fused", "torch-vmap")
_MIXED_WIDTHS = (16, 32, 48, 64)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `run_pack_benchmark` measures.

    Args:
        members: member counts to run. Defaults to `(1, 4, 16)`.
        samples: training rows per epoch. Defaults to `25_000`.
        epochs: epochs per run (the last one gives the steady-state rate). Defaults to `2`.
        methods: methods to run, from `METHODS`. Defaults to all but the torch peer.
        architecture: `"same"` (all the seeds' 10-64-32-1 model) or `"mixed"` (first
            hidden widths 16/32/48/64 in turn: the graph engine's case; the fused engine
            and the torch peer need one architecture and are left out). Defaults to
            `"same"`.
        sequential_at_most: train at most this many members sequentially and scale the
            time to all of them (sequential fits cost the same per member). Defaults to
            `None` (train them all).
    """

    members: tuple[int, ...] = (1, 4, 16)
    samples: int = 25_000
    epochs: int = 2
    methods: tuple[str, ...] = ("sequential", "pool", "pack-graph", "pack-fused")
    architecture: str = "same"
    sequential_at_most: int | None = None

    @classmethod
    def quick(cls) -> BenchConfig:
        """A run of about a minute on two CPU cores: the `make demo` job (the seeds' model)."""
        return cls(members=(1, 4), samples=10_000, epochs=2, architecture="same")

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
            if architecture not in ("mixed", "same"):
                raise ValueError(
                    f'Invalid value for --architecture: got {architecture!r}. Expected "mixed" '
                    'or "same".'
                )
            changes["architecture"] = architecture
        if sequential_at_most is not None:
            changes["sequential_at_most"] = _positive(sequential_at_most, "--sequential-at-most")
        return dataclasses.replace(self, **changes)

    def widths(self, n: int) -> list[int]:
        """The first hidden layer's width of each of `n` members."""
        if self.architecture == "same":
            return [64] * n
        return [_MIXED_WIDTHS[i % len(_MIXED_WIDTHS)] for i in range(n)]


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise ValueError(f"Invalid value for {flag}: got {value}, expected a positive integer.")
    return value


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"Invalid value for {flag}: got {text!r}, expected comma-separated integers such "
            "as 1,4,16."
        ) from None
    return [_positive(v, flag) for v in values]


def _runs(config: BenchConfig) -> list[tuple[str, int, dict[str, Any]]]:
    runs = []
    for n in config.members:
        base = {"samples": config.samples, "epochs": config.epochs, "widths": config.widths(n)}
        for method in config.methods:
            if method == "pool":
                for processes in sorted({min(2, n), n}):
                    runs.append((f"pool({processes})", n, {**base, "processes": processes}))
            elif method in ("torch-vmap", "pack-fused") and config.architecture == "mixed":
                logger.info("bench: %s needs one architecture; left out of a mixed run", method)
            elif method == "torch-vmap":
                if importlib.util.find_spec("torch") is not None:
                    runs.append((method, n, base))
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
    """Runs every method for every member count: `(method, members, measurements)` rows.

    `format_report` turns them into the table; `keras_gpushare._bench.plot` into a PNG.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    results = []
    for method, n, run_config in _runs(config):
        logger.info("bench: %s with %d members", method, n)
        results.append((method, n, _run_isolated(method, run_config)))
    return results


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
    lines = [
        "keras-gpushare bench: the seeds' MLP (10-w-32-1, Adam, batch 32)",
        f"machine: {_device_line()}",
        f"{config.samples} samples x {config.epochs} epochs per member; widths "
        f"{'16/32/48/64' if config.architecture == 'mixed' else '64'}",
        "",
        f"{'N':>4}  {'method':<12} {'end-to-end s':>12} {'x seq':>7} "
        f"{'steady model-samples/s':>23} {'x seq':>7} {'peak RSS MiB':>13}",
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
        lines.append(
            f"{n:>4}  {method:<12} {r['wall_s']:>12.1f} {wall_ratio:>7} "
            f"{r['steady_rate']:>23,.0f} {rate_ratio:>7} {r['peak_rss_mib']:>13,.0f}{note}"
        )
    lines.append("")
    lines.append("x seq: how many times faster than sequential fits (higher is better).")
    return "\n".join(lines)
