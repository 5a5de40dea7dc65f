"""Benchmark: 16 trials of a small MLP search, plain KerasTuner vs ParallelTuner.

Every method runs the same RandomSearch (same seed, so the same 16 hyperparameter sets:
units, learning rate, dropout) for the same epochs on the same data: plain KerasTuner one
trial after the other; ParallelTuner with executor="pack" at K=4, 8, 16 trials per pack;
ParallelTuner with executor="processes" and 2 workers. Prints wall time, the ratio of plain
KerasTuner's time to each method's (same run), and the best and worst trial scores.

    python benchmarks/tuner.py [--quick] [--trials 16] [--epochs 5] [--packs 4,8,16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_tuner  # noqa: E402
import numpy as np  # noqa: E402

import keras_gpushare as kg  # noqa: E402

DEVICES = kg.share_gpu()  # memory growth: the processes executor's workers share the GPU
FEATURES = 20


def build(hp: keras_tuner.HyperParameters) -> keras.Model:
    """The searched model: a 20-units-1 MLP with dropout; module level so workers import it."""
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(hp.Choice("units", [32, 64, 128]), activation="relu"),
            keras.layers.Dropout(hp.Float("dropout", 0.0, 0.5, step=0.1)),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(hp.Float("lr", 1e-4, 1e-2, sampling="log")),
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    return model


def make_data(samples: int) -> tuple:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.3 * rng.normal(size=(samples, 1)) > 0).astype("float32")
    return x, y


def run(method: str, k: int, args: argparse.Namespace, data: tuple, root: str) -> tuple:
    """Runs one search; returns (seconds, scores of the completed trials)."""
    common = dict(directory=root, project_name=f"{method}-{k}", overwrite=True)
    if method == "plain":
        tuner = keras_tuner.RandomSearch(
            build, objective="val_loss", max_trials=args.trials, seed=1, **common
        )
    else:
        tuner = kg.tuner.ParallelTuner(
            build,
            objective="val_loss",
            max_trials=args.trials,
            seed=1,
            parallel_trials=k,
            executor=method,
            **common,
        )
    x, y = data
    start = time.perf_counter()
    tuner.search(x, y, epochs=args.epochs, batch_size=args.batch, validation_split=0.2, verbose=0)
    seconds = time.perf_counter() - start
    scores = [t.score for t in tuner.oracle.trials.values() if t.status == "COMPLETED"]
    return seconds, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 trials, 2 epochs, K=4 only")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--packs", default="4,8,16", help="pack sizes K to run")
    parser.add_argument("--workers", type=int, default=2, help="processes executor workers")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.epochs, args.packs, args.samples = 4, 2, "4", 1024
    data = make_data(args.samples)
    methods = [("plain", 1)]
    methods += [("pack", int(k)) for k in args.packs.split(",") if k]
    if args.workers:
        methods.append(("processes", args.workers))
    root = tempfile.mkdtemp(prefix="kg-tuner-bench-")
    print(
        f"{args.trials} trials x {args.epochs} epochs, {args.samples} samples, "
        f"batch {args.batch}, device: {DEVICES[0]}"
    )
    print(f"{'method':<22}{'wall s':>9}{'vs plain':>10}{'best':>9}{'worst':>9}{'trials':>8}")
    baseline = None
    try:
        for method, k in methods:
            seconds, scores = run(method, k, args, data, root)
            baseline = baseline or seconds
            name = "KerasTuner RandomSearch" if method == "plain" else f"{method} K={k}"
            print(
                f"{name:<22}{seconds:>9.1f}{baseline / seconds:>9.2f}x"
                f"{min(scores):>9.4f}{max(scores):>9.4f}{len(scores):>8}",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
