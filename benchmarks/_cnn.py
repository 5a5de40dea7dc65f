"""The CNN suite of pack_vs_baselines.py: a small CNN (two Conv2D and a Dense on 28x28x1
images), fused engine against graph engine, each in a fresh process."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import time
from typing import Any

import numpy as np

from keras_gpushare._seeds_benchmark.measure import interleaved, summarize
from keras_gpushare._seeds_benchmark.workload import epoch_timer

_EPOCHS, _WARMUP = 4, 2


def _build_cnn(seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def _run(config: dict[str, Any]) -> dict[str, float]:
    import keras_gpushare as kg

    rng = np.random.default_rng(0)
    x = rng.random((config["samples"], 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, size=(config["samples"],))
    start = time.perf_counter()
    pack = kg.ModelPack(
        [_build_cnn(i) for i in range(config["members"])], fuse=config["engine"] == "fused"
    )
    pack.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    timer = epoch_timer()
    pack.fit(x, y, batch_size=32, epochs=_EPOCHS, verbose=0, callbacks=[timer])
    rates = [config["members"] * config["samples"] / t for t in timer.times[_WARMUP:]]
    return {
        "engine": pack.engine,
        "wall_s": time.perf_counter() - start,
        "steady_rate": float(np.median(rates)),
        "peak_rss_mib": 0.0,
    }


def run_cnn_benchmark(members: int = 16, samples: int = 2048, repeats: int = 3) -> str:
    """Runs the CNN pack on both engines, each run in a fresh process, `repeats` times in
    turn, and returns a report (medians over the repeats, with their range)."""
    engines = ("graph", "fused")
    measured: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    context = mp.get_context("spawn")
    for _, k in interleaved(len(engines), repeats):
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as executor:
            config = {"members": members, "samples": samples, "engine": engines[k]}
            measured[k].append(executor.submit(_run, config).result())
    rows = [{**summarize(measured[k]), "engine": engines[k]} for k in range(len(engines))]
    graph, fused = rows
    lines = [
        f"small CNN (Conv2D 8, Conv2D 16, Dense 10 on 28x28x1), N={members}, batch 32, "
        f"{samples} samples x {_EPOCHS} epochs; steady: median of epochs {_WARMUP + 1}-"
        f"{_EPOCHS}, median [min-max] over {repeats} interleaved repeats",
        f"{'engine':<8} {'end-to-end s':>12} {'steady model-samples/s':>23} {'[min-max]':>21}",
    ]
    for r in rows:
        spread = f"[{r['rate_min']:,.0f}-{r['rate_max']:,.0f}]"
        lines.append(
            f"{r['engine']:<8} {r['wall_s']:>12.1f} {r['steady_rate']:>23,.0f} {spread:>21}"
        )
    lines.append(
        f"fused / graph: {fused['steady_rate'] / graph['steady_rate']:.2f}x steady state, "
        f"{graph['wall_s'] / fused['wall_s']:.2f}x end to end"
    )
    return "\n".join(lines)
