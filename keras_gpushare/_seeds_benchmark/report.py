"""The `keras-gpushare bench` table: medians, ranges and ratios against sequential fits."""

from __future__ import annotations

import math
import os
import platform

from keras_gpushare._seeds_benchmark.config import ARCHITECTURE_LINES, BenchConfig
from keras_gpushare._seeds_benchmark.measure import Row


def format_report(config: BenchConfig, results: list[Row]) -> str:
    """The benchmark table, with ratios against sequential fits at the same member count."""
    threads = config.threads or "default"
    lines = [
        "keras-gpushare bench: the seeds' MLP (10-w-32-1, Adam, batch 32)",
        f"machine: {_device_line()}",
        f"load average (1 min) when the runs started: {_load(results)}",
        f"{config.samples} samples x {config.epochs} epochs per member; "
        f"{ARCHITECTURE_LINES[config.architecture]}",
        f"steady: median of epochs {config.warmup + 1}-{config.epochs} of a run; median "
        f"[min-max] over {config.repeats} interleaved repeat(s); TensorFlow threads per "
        f"process: {threads}",
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


def _load(results: list[Row]) -> str:
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
