"""The CNN suite of pack_vs_baselines.py: a small CNN (two Conv2D and a Dense on 28x28x1
images), fused engine against graph engine, each in a fresh process."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import time
from typing import Any

import numpy as np

from keras_gpushare._bench.workload import epoch_timer


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
    pack.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[timer])
    return {
        "engine": pack.engine,
        "wall_s": time.perf_counter() - start,
        "steady_rate": config["members"] * config["samples"] / timer.times[-1],
    }


def run_cnn_benchmark(members: int = 16, samples: int = 2048) -> str:
    """Runs the CNN pack on both engines, each in a fresh process, and returns a report."""
    rows = []
    context = mp.get_context("spawn")
    for engine in ("graph", "fused"):
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as executor:
            config = {"members": members, "samples": samples, "engine": engine}
            rows.append(executor.submit(_run, config).result())
    graph, fused = rows
    lines = [
        f"small CNN (Conv2D 8, Conv2D 16, Dense 10 on 28x28x1), N={members}, batch 32, "
        f"{samples} samples x 2 epochs",
        f"{'engine':<8} {'end-to-end s':>12} {'steady model-samples/s':>23}",
    ]
    for r in rows:
        lines.append(f"{r['engine']:<8} {r['wall_s']:>12.1f} {r['steady_rate']:>23,.0f}")
    lines.append(
        f"fused / graph: {fused['steady_rate'] / graph['steady_rate']:.2f}x steady state, "
        f"{graph['wall_s'] / fused['wall_s']:.2f}x end to end"
    )
    return "\n".join(lines)
