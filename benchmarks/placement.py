"""Benchmark: a deep MLP split in two stages with 1, 2, 4, 8 micro-batches vs unsplit.

Runs on two logical devices: two logical GPUs carved from the first GPU when there is one,
else two logical CPUs carved from the CPU. Prints the step time of each configuration,
its ratio to the unsplit model's step time (same run, same devices), and per-stage peak
memory (measured on GPUs, estimated by the plan everywhere).

    python benchmarks/placement.py [--quick] [--layers 8] [--width 1024] [--batch 256]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_gpushare as kg  # noqa: E402

DEVICES = kg.share_gpu(split=2, memory_limit_mb=8192)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def build(layers: int, width: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    stack = [keras.Input((width,))]
    stack += [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
    stack += [keras.layers.Dense(10)]
    return keras.Sequential(stack)


def step_time(model: keras.Model, x: np.ndarray, y: np.ndarray, steps: int) -> float:
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        model.train_on_batch(x, y)
    return (time.perf_counter() - start) / steps


def peak_mib(device: str) -> str:
    """Peak bytes of the device's allocator; logical CPUs share one, so it is marked."""
    try:
        peak = tf.config.experimental.get_memory_info(device)["peak"] / 2**20
    except (ValueError, RuntimeError):
        return "n/a"
    return f"{peak:.0f}" + (" (shared CPU allocator)" if "CPU" in device else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller steps")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.quick:
        args.width, args.steps = 512, 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.width), dtype=np.float32)
    y = rng.standard_normal((args.batch, 10), dtype=np.float32)
    print(f"devices: {DEVICES[:2]}; MLP {args.layers}x{args.width}, batch {args.batch}")

    base = build(args.layers, args.width)
    with tf.device(DEVICES[0]):
        base.compile(optimizer="adam", loss="mse", jit_compile=False)
        t_base = step_time(base, x, y, args.steps)
    rows = [("unsplit", t_base, 1.0, "", "")]
    for m in (1, 2, 4, 8):
        placed = kg.split_model(build(args.layers, args.width), DEVICES[:2], microbatches=m)
        placed.compile(optimizer="adam", loss="mse")
        t = step_time(placed, x, y, args.steps)
        plan = placed.get_plan(batch_size=args.batch)
        est = " / ".join(f"{b / 2**20:.0f}" for b in plan.memory_bytes)
        measured = " / ".join(peak_mib(d) for d in placed.devices)
        if "CPU" in placed.devices[0]:
            measured = peak_mib(placed.devices[0])
        rows.append((f"2 stages, M={m}", t, t / t_base, est, measured))
    print(f"{'config':<16} {'step ms':>8} {'ratio':>6}  {'est. MiB/stage':>16}  peak MiB/stage")
    for name, t, ratio, est, measured in rows:
        print(f"{name:<16} {1e3 * t:8.1f} {ratio:6.2f}  {est:>16}  {measured}")
    bubble = ", ".join(f"M={m}: {(2 - 1) / (m + 2 - 1):.2f}" for m in (1, 2, 4, 8))
    print(f"GPipe bubble (K-1)/(M+K-1) for K=2: {bubble}")


if __name__ == "__main__":
    main()
