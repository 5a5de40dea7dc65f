"""The steady-state cost of per-member settings held as data instead of traced constants.

A pack whose fused layers are built for slots (`ModelPack(..., _slot_values=True)`, what
ParallelTuner's slots use) holds each member's Dense width, activation, bias and dropout rate
as variables of the compiled step, so a member of another width or activation loads in place
(`load_member`) without a new trace. The price is paid at every step: masks built from the
widths instead of baked in, every activation of the template computed and one selected, the
general dropout path. This measures it on the worst case for it, tiny models on a CPU, and on
KerasTuner's getting-started MLPs: the same members trained as a pack with constants and as a
pack with slot values, each run in a fresh process, the runs interleaved, medians [min-max]
over the repeats of a steady epoch (median of the epochs after the first) and of the first.

Cases:
    tiny: 16 MLPs 8-(4..16)-1, relu/tanh, 1,024 samples, batch 32.
    getting-started: 16 MLPs 784-(32..256)-(32..256)-10 with Dropout(0 or 0.25), relu/tanh
        (KerasTuner's getting-started space at depth 2), 4,096 samples, batch 64.
    tiny-two-families, getting-started-two-families: the same, every other member with SGD
        (momentum 0.9) instead of Adam (the optimizer family as data).

    KERAS_BACKEND=jax python benchmarks/slot_values.py [--cases tiny,getting-started]
        [--repeats 3] [--epochs 4]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from keras_gpushare._seeds_benchmark.measure import interleaved  # noqa: E402
from keras_gpushare._seeds_benchmark.workload import epoch_timer  # noqa: E402

METHODS = ("constants", "slot-values")
CASES = {
    "tiny": {
        "features": (8,),
        "hidden": [(4, 8, 12, 16)],
        "classes": 1,
        "dropout": False,
        "samples": 1024,
        "batch": 32,
    },
    "getting-started": {
        "features": (28, 28),
        "hidden": [(32, 96, 160, 256), (64, 128, 192, 32)],
        "classes": 10,
        "dropout": True,
        "samples": 4096,
        "batch": 64,
    },
}
# The same members, half of them with SGD (momentum 0.9) instead of Adam: with slot values
# the optimizer family is data too, each family's rule computed for every member.
for _name in list(CASES):
    CASES[f"{_name}-two-families"] = {**CASES[_name], "families": 2}


def _member(case: dict[str, Any], i: int):
    import keras

    keras.utils.set_random_seed(i)
    activation = ("relu", "tanh")[(i // 4) % 2]
    layers = [keras.Input(case["features"]), keras.layers.Flatten()]
    for widths in case["hidden"]:
        layers.append(keras.layers.Dense(widths[i % len(widths)], activation=activation))
    if case["dropout"]:
        layers.append(keras.layers.Dropout((0.0, 0.25)[i % 2]))
    if case["classes"] == 1:
        layers.append(keras.layers.Dense(1))
    else:
        layers.append(keras.layers.Dense(case["classes"], activation="softmax"))
    return keras.Sequential(layers)


def _run(method: str, case: dict[str, Any], epochs: int) -> dict[str, Any]:
    """One pack of the case's 16 members, in this (fresh) process."""
    import keras

    import keras_gpushare as kg

    rng = np.random.default_rng(0)
    x = rng.random(size=(case["samples"], *case["features"])).astype("float32")
    if case["classes"] == 1:
        y, loss = x.reshape(len(x), -1)[:, :2].sum(axis=1, keepdims=True), "mse"
    else:
        y, loss = (
            rng.integers(0, case["classes"], size=(len(x),)),
            "sparse_categorical_crossentropy",
        )
    start = time.perf_counter()
    members = [_member(case, i) for i in range(16)]
    for i, member in enumerate(members):
        rate = 1e-3 * (1 + i % 3)
        if case.get("families", 1) == 2 and i % 2:
            optimizer = keras.optimizers.SGD(10 * rate, momentum=0.9)
        else:
            optimizer = keras.optimizers.Adam(rate)
        member.compile(optimizer=optimizer, loss=loss)
    pack = kg.ModelPack(members, _slot_values=method == "slot-values")
    pack.compile()
    timer = epoch_timer()
    pack.fit(x, y, batch_size=case["batch"], epochs=epochs, verbose=0, callbacks=[timer])
    return {
        "wall_s": time.perf_counter() - start,
        "first_s": timer.times[0],
        "steady_s": statistics.median(timer.times[1:] or timer.times),
        "engine": pack.engine,
    }


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def _report(name: str, results: dict[str, list[dict]], epochs: int) -> str:
    import keras

    repeats = max(len(r) for r in results.values())
    lines = [
        f"{name} ({keras.backend.backend()}): 16 members x {epochs} epochs; median [min-max] "
        f"over {repeats} interleaved repeats; ratio = slot values / constants",
        f"{'method':<12} {'steady epoch s':>22} {'first epoch s':>22} {'end-to-end s':>22}",
    ]
    keys = ("steady_s", "first_s", "wall_s")
    for method, runs in results.items():
        cells = [_spread([r[k] for r in runs]) for k in keys]
        lines.append(f"{method:<12} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22}")
    median = {
        m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in results.items()
    }
    ratios = [median["slot-values"][k] / median["constants"][k] for k in keys]
    lines.append(f"{'ratio':<12} {ratios[0]:>21.2f}x {ratios[1]:>21.2f}x {ratios[2]:>21.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="tiny,getting-started")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        if name not in CASES:
            parser.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")
        results: dict[str, list[dict]] = {m: [] for m in METHODS}
        for _, k in interleaved(len(METHODS), args.repeats):
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as executor:
                run = executor.submit(_run, METHODS[k], CASES[name], args.epochs)
                results[METHODS[k]].append(run.result())
        print(_report(name, results, args.epochs), flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
