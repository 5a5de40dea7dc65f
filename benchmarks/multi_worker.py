"""Benchmark: K members trained by W workers (MultiWorkerMirroredStrategy), one pack vs one by one.

Plain `keras.Model.fit` fails under several workers in Keras 3.15 (keras-team/keras#20585),
so the one-by-one baseline trains each member as a one-member ModelPack, one after another,
inside the same worker processes (process start-up is paid once by every method). Also timed:
the K-member pack in one process without a strategy. Each method is one launch of W local
workers (`kg.run_local_workers`); the chief reports the training time of each epoch.

    python benchmarks/multi_worker.py [--quick] [--members 8] [--workers 2] [--epochs 3]
        [--architecture mixed|same]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _build(width: int):
    import keras

    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def _train(method: str, args: argparse.Namespace) -> None:
    """One worker's run (or the single process's): writes the chief's epoch times."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_gpushare as kg

    distributed = method != "pack-one-process"
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if distributed else None
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 10)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")
    widths = [(16, 32, 48, 64)[i % 4] for i in range(args.members)]
    if args.architecture == "same":
        widths = [64] * args.members

    class EpochTimes(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    def make(group):
        pack = kg.ModelPack([_build(w) for w in group])
        pack.compile(optimizer="adam", loss="binary_crossentropy")
        return pack

    groups = [[w] for w in widths] if method == "one-by-one" else [widths]
    member_epochs = []
    for group in groups:
        times: list[float] = []
        if strategy is None:
            pack = make(group)
        else:
            with strategy.scope():
                pack = make(group)
        pack.fit(
            x, y, batch_size=args.batch, epochs=args.epochs, callbacks=[EpochTimes()], verbose=0
        )
        member_epochs.append(times)
    if strategy is None or strategy.extended.should_checkpoint:
        with open(args.report, "w") as f:
            json.dump({"engine": pack.engine, "epochs": member_epochs}, f)


def _launch(method: str, args: argparse.Namespace) -> dict:
    import keras_gpushare as kg

    report = os.path.join(args.out, f"{method}.json")
    command = [sys.executable, os.path.abspath(__file__), "--worker", method, "--report", report]
    options = ("members", "samples", "batch", "epochs", "architecture")
    command += [f"--{k}={getattr(args, k)}" for k in options]
    start = time.perf_counter()
    workers = 1 if method == "pack-one-process" else args.workers
    code = kg.run_local_workers(command, num_workers=workers, log_dir=args.out, timeout=3600)
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{method} failed (exit {code}); logs in {args.out}")
    with open(report) as f:
        result = json.load(f)
    total = sum(sum(times) for times in result["epochs"])
    steady = sum(sum(times[1:]) for times in result["epochs"])
    return {"wall": wall, "train": total, "steady": steady, "engine": result["engine"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--architecture",
        choices=["mixed", "same"],
        default="mixed",
        help="first hidden widths 16/32/48/64 in turn (graph engine) or all 64 (fused)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _train(args.worker, args)
        return
    if args.quick:
        args.members, args.samples, args.epochs = 4, 4_096, 2
    args.out = tempfile.mkdtemp(prefix="bench_multi_worker_")
    print(
        f"{args.members} members ({args.architecture} architecture), {args.workers} workers, "
        f"{args.samples} samples, global batch {args.batch}, {args.epochs} epochs"
    )
    results = {m: _launch(m, args) for m in ("one-by-one", "pack", "pack-one-process")}
    base = results["one-by-one"]
    header = f"{'method':<18} {'engine':<7} {'wall s':>8} {'train s':>8} {'steady s':>9}"
    print(f"{header}  vs one-by-one")
    for method, r in results.items():
        ratio = base["train"] / r["train"]
        steady = base["steady"] / r["steady"] if r["steady"] else float("nan")
        print(
            f"{method:<18} {r['engine']:<7} {r['wall']:8.1f} {r['train']:8.1f} "
            f"{r['steady']:9.2f}  {ratio:.2f}x train, {steady:.2f}x steady"
        )


if __name__ == "__main__":
    main()
