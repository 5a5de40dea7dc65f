"""Sequence-model packs against their baselines: LSTM forecasters and small transformers.

Workloads (both on the same random data for every method):
- `lstm`: 16 forecasters, LSTM(16) on 24 steps x 4 features, Dense(1), Adam, MSE;
- `transformer`: 8 classifiers, Embedding(1000, 32) on 32 tokens, one MultiHeadAttention
  block (2 heads x 16) with residual and LayerNormalization, average pooling, Dense(2),
  Lion. (With Adam on TensorFlow, members with an Embedding train on the graph engine:
  Keras's sparse Adam updates there cannot be matched fused, see docs/fusion.md, Limits.
  `--transformer-optimizer adam` measures that case.)

Methods: `sequential` (plain `fit` of one model after the other, the users' starting point),
`graph` (a ModelPack on the graph engine, `fuse=False`), `fused` (`fuse="auto"`, with the
default `jit_compile="auto"`: XLA) and `fused-no-xla` (`jit_compile=False`: no XLA compile
time, slower steps). Every
run is a fresh process; runs are interleaved (sequential, graph, fused, sequential, ...) and
repeated, so a busy machine slows all methods alike. Reported per method: end-to-end seconds
(model building, compilation and every epoch) and the steady model-samples/s (members x
samples per epoch, over the median epoch after the first), each as the median over repeats
with min-max, and the ratios of the medians against sequential fits.

    python benchmarks/sequence.py                       # both workloads, 3 repeats
    python benchmarks/sequence.py --workload lstm --repeats 5 --epochs 6
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

METHODS = ("sequential", "graph", "fused", "fused-no-xla")
WORKLOADS = {
    "lstm": {"members": 16, "samples": 2048, "batch_size": 32},
    "transformer": {"members": 8, "samples": 2048, "batch_size": 32},
}


def _optimizer(name: str) -> Any:
    import keras

    return keras.optimizers.Lion(1e-4) if name == "lion" else keras.optimizers.Adam(1e-3)


def _lstm(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((24, 4)), keras.layers.LSTM(16), keras.layers.Dense(1)],
    )


def _transformer(seed: int):
    import keras
    from keras import layers

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((32,), dtype="int32")
    x = layers.Embedding(1000, 32)(tokens)
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=16)(x, x)
    x = layers.LayerNormalization()(layers.Add()([x, attended]))
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, layers.Dense(2, activation="softmax")(x))


def _data(workload: str, samples: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if workload == "lstm":
        x = rng.normal(size=(samples, 24, 4)).astype("float32")
        return x, (x[:, -3:, 0].mean(axis=1, keepdims=True) + 0.1).astype("float32")
    x = rng.integers(1, 1000, size=(samples, 32)).astype("int32")
    return x, (x[:, :4].sum(axis=1) % 2).astype("int32")


def _compile_args(workload: str) -> dict[str, Any]:
    if workload == "lstm":
        return {"loss": "mse"}
    return {"loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]}


def _epoch_timer():
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    return EpochTimer()


def run_once(workload: str, method: str, epochs: int, optimizer: str) -> dict[str, Any]:
    """One measurement in this (fresh) process: end-to-end seconds, epoch times, engine."""

    import keras_gpushare as kg

    spec = WORKLOADS[workload]
    build = _lstm if workload == "lstm" else _transformer
    x, y = _data(workload, spec["samples"])
    fit_args = dict(batch_size=spec["batch_size"], epochs=epochs, verbose=0, shuffle=False)
    start = time.perf_counter()
    if method == "sequential":
        per_epoch = np.zeros(epochs)
        for i in range(spec["members"]):
            model = build(i)
            model.compile(optimizer=_optimizer(optimizer), **_compile_args(workload))
            timer = _epoch_timer()
            model.fit(x, y, callbacks=[timer], **fit_args)
            per_epoch += np.asarray(timer.times)
        engine = "-"
    else:
        members = [build(i) for i in range(spec["members"])]
        pack = kg.ModelPack(members, fuse="auto" if method.startswith("fused") else False)
        optimizers = [_optimizer(optimizer) for _ in range(spec["members"])]
        jit = False if method == "fused-no-xla" else "auto"
        pack.compile(optimizer=optimizers, jit_compile=jit, **_compile_args(workload))
        timer = _epoch_timer()
        pack.fit(x, y, callbacks=[timer], **fit_args)
        per_epoch = np.asarray(timer.times)
        engine = pack.engine
    wall = time.perf_counter() - start
    steady = float(np.median(per_epoch[1:])) if epochs > 1 else float(per_epoch[0])
    return {
        "wall_s": wall,
        "steady_rate": spec["members"] * spec["samples"] / steady,
        "engine": engine,
    }


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def benchmark(workload: str, repeats: int, epochs: int, optimizer: str) -> str:
    """Runs every method `repeats` times, interleaved, each in a fresh process."""
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    context = mp.get_context("spawn")
    for _ in range(repeats):
        for method in METHODS:
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as executor:
                run = executor.submit(run_once, workload, method, epochs, optimizer)
                results[method].append(run.result())
    spec = WORKLOADS[workload]
    base_wall = statistics.median(r["wall_s"] for r in results["sequential"])
    base_rate = statistics.median(r["steady_rate"] for r in results["sequential"])
    lines = [
        f"{workload}: {spec['members']} members, {spec['samples']} samples x {epochs} epochs, "
        f"batch {spec['batch_size']}, {optimizer}; median (min-max) of {repeats} interleaved runs",
        f"{'method':<12} {'engine':<7} {'end-to-end s':>22} {'steady model-samples/s':>28} "
        f"{'e2e vs seq':>10} {'steady vs seq':>13}",
    ]
    for method in METHODS:
        rows = results[method]
        walls = [r["wall_s"] for r in rows]
        rates = [r["steady_rate"] for r in rows]
        lines.append(
            f"{method:<12} {rows[0]['engine']:<7} {_spread(walls, '.1f'):>22} "
            f"{_spread(rates, ',.0f'):>28} {base_wall / statistics.median(walls):>9.2f}x "
            f"{statistics.median(rates) / base_rate:>12.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=(*WORKLOADS, "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--transformer-optimizer", choices=("lion", "adam"), default="lion", help="see above"
    )
    args = parser.parse_args()
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    for workload in workloads:
        optimizer = args.transformer_optimizer if workload == "transformer" else "adam"
        print(benchmark(workload, args.repeats, args.epochs, optimizer), flush=True)


if __name__ == "__main__":
    main()
