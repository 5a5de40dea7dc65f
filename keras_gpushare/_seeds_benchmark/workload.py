"""The seeds' workload, run one way per function, each in a fresh process.

Every runner trains `members` MLPs (10-w-32-1, Adam, binary cross-entropy, batch 32) for
`epochs` epochs over the same `samples` random rows and returns a dict of measurements:
`wall_s` (end to end, model building included), `epoch_rates` (aggregate model-samples per
second of each epoch after the first `warmup` ones), `steady_rate` (their median) and
`peak_rss_mib` (summed over the processes it used); packs also return every epoch's seconds
(`epoch_s`).

`config["threads"]` (0: TensorFlow's default) caps TensorFlow's intra- and inter-op pools in
each process. It must be set before TensorFlow starts its pools, so every runner applies it
first.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Any

import numpy as np


def make_data(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs and 0/1 labels as in the seeds: `x` of shape (samples, 10)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 10)).astype("float32")
    y = rng.integers(0, 2, size=(samples, 1)).astype("float32")
    return x, y


def build_mlp(spec: Any, seed: int):
    """The seeds' model, 10-`spec`-32-1 for an int `spec`.

    A `[width, depth, activation]` spec gives `depth` hidden layers (`width` units, then 32
    each) with `activation`: the seeds' model is `[64, 2, "relu"]`.
    """
    import keras

    width, depth, activation = (spec, 2, "relu") if isinstance(spec, int) else spec
    keras.utils.set_random_seed(seed)
    hidden = [width] + [32] * (depth - 1)
    return keras.Sequential(
        [
            keras.Input((10,)),
            *[keras.layers.Dense(units, activation=activation) for units in hidden],
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _apply_threads(config: dict[str, Any]) -> None:
    """Caps this process's TensorFlow pools at `config["threads"]` (0 leaves the defaults)."""
    threads = int(config.get("threads") or 0)
    if threads <= 0:
        return
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def timed_epochs(times: list[float], config: dict[str, Any]) -> list[float]:
    """The epochs after the warm-up (at least the last one)."""
    warmup = int(config.get("warmup", 1))
    return times[warmup:] or times[-1:]


def throughput(
    model_samples: float, times: list[float], cpu_times: list[float] | None = None
) -> dict[str, Any]:
    """`epoch_rates` (model-samples per second of each of `times`), `steady_rate` (their
    median) and, given `cpu_times`, `cpu_rate` (the median per second of CPU time)."""
    per_epoch = [model_samples / t for t in times]
    out = {"epoch_rates": per_epoch, "steady_rate": float(statistics.median(per_epoch))}
    if cpu_times:
        out["cpu_rate"] = float(statistics.median(model_samples / t for t in cpu_times))
    return out


def epoch_timer():
    """A callback recording each epoch's duration in `.times` and this process's CPU time
    during it in `.cpu_times`."""
    import keras

    class EpochTimer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times: list[float] = []
            self.cpu_times: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()
            self._cpu = time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self._start)
            self.cpu_times.append(time.process_time() - self._cpu)

    return EpochTimer()


def run_sequential(config: dict[str, Any]) -> dict[str, float]:
    """Plain `fit` for one member after another (the users' starting point)."""
    _apply_threads(config)
    start = time.perf_counter()
    x, y = make_data(config["samples"])
    timed: list[float] = []
    cpu: list[float] = []
    for i, width in enumerate(config["widths"]):
        model = build_mlp(width, seed=i)
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
        timer = epoch_timer()
        model.fit(x, y, batch_size=32, epochs=config["epochs"], verbose=0, callbacks=[timer])
        timed += timed_epochs(timer.times, config)
        cpu += timed_epochs(timer.cpu_times, config)
    return {
        "wall_s": time.perf_counter() - start,
        # One member trains at a time: the aggregate rate is one fit's rate.
        **throughput(config["samples"], timed, cpu),
        "peak_rss_mib": peak_rss_mib(),
    }


def _pool_task(args: tuple[int, int, dict[str, Any]]) -> dict[str, Any]:
    i, width, config = args
    _apply_threads(config)
    x, y = make_data(config["samples"])
    model = build_mlp(width, seed=i)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    timer = epoch_timer()
    model.fit(x, y, batch_size=32, epochs=config["epochs"], verbose=0, callbacks=[timer])
    return {"pid": os.getpid(), "timed": timed_epochs(timer.times, config), "rss": peak_rss_mib()}


def run_pool(config: dict[str, Any]) -> dict[str, float]:
    """The seeds' method 1: a spawn process pool, one `fit` per member."""
    import multiprocessing as mp

    start = time.perf_counter()
    processes = config["processes"]
    tasks = [(i, w, config) for i, w in enumerate(config["widths"])]
    with mp.get_context("spawn").Pool(processes) as pool:
        results = pool.map(_pool_task, tasks, chunksize=1)
    wall = time.perf_counter() - start
    rss_by_pid: dict[int, float] = {}
    for r in results:
        rss_by_pid[r["pid"]] = max(rss_by_pid.get(r["pid"], 0.0), r["rss"])
    # `processes` fits run at once, each at about the rate of its epochs.
    timed = [t for r in results for t in r["timed"]]
    return {
        "wall_s": wall,
        **throughput(config["samples"] * min(processes, len(tasks)), timed),
        "peak_rss_mib": peak_rss_mib() + sum(rss_by_pid.values()),
    }


def run_pack(config: dict[str, Any]) -> dict[str, float]:
    """All members in one `ModelPack` (engine chosen by `config["fuse"]`)."""
    _apply_threads(config)
    import keras_gpushare as kg

    start = time.perf_counter()
    x, y = make_data(config["samples"])
    members = [build_mlp(w, seed=i) for i, w in enumerate(config["widths"])]
    pack = kg.ModelPack(members, fuse=config.get("fuse", False))
    pack.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    plan = pack.engine_plan
    groups = [
        f"{len(group)}" + (f" ({waste:.0%} padding)" if waste else "")
        for group, waste in zip(plan.groups, plan.waste + [0.0] * len(plan.groups))
    ]
    note = f"fused groups: {', '.join(groups)}" if groups else ""
    if groups and plan.graph:
        note += f"; {len(plan.graph)} on the graph engine"
    timer = epoch_timer()
    pack.fit(x, y, batch_size=32, epochs=config["epochs"], verbose=0, callbacks=[timer])
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        **throughput(
            len(members) * config["samples"],
            timed_epochs(timer.times, config),
            timed_epochs(timer.cpu_times, config),
        ),
        "epoch_s": timer.times,
        "peak_rss_mib": peak_rss_mib(),
        "engine": pack.engine,
        "note": note,
    }
