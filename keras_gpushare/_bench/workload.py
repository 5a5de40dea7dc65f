"""The seeds' workload, run one way per function, each in a fresh process.

Every runner trains `members` MLPs (10-w-32-1, Adam, binary cross-entropy, batch 32) for
`epochs` epochs over the same `samples` random rows and returns a dict of measurements:
`wall_s` (end to end, model building included), `epoch_rates` (aggregate model-samples per
second of each epoch after the first `warmup` ones), `steady_rate` (their median) and
`peak_rss_mib` (summed over the processes it used); packs and the torch peer also return
every epoch's seconds (`epoch_s`).

`config["threads"]` (0: the framework's default) caps the threads of each process: TensorFlow's
intra- and inter-op pools, torch's intra-op pool. It must be set before the framework starts
its pools, so every runner applies it first.
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


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _apply_threads(config: dict[str, Any], torch: bool = False) -> None:
    """Caps this process's thread pools at `config["threads"]` (0 leaves the defaults)."""
    threads = int(config.get("threads") or 0)
    if threads <= 0:
        return
    if torch:
        import torch as torch_module

        torch_module.set_num_threads(threads)
        return
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def _timed(times: list[float], config: dict[str, Any]) -> list[float]:
    """The epochs after the warm-up (at least the last one)."""
    warmup = int(config.get("warmup", 1))
    return times[warmup:] or times[-1:]


def _rates(
    model_samples: float, times: list[float], cpu_times: list[float] | None = None
) -> dict[str, Any]:
    rates = [model_samples / t for t in times]
    out = {"epoch_rates": rates, "steady_rate": float(statistics.median(rates))}
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
    """Plain `fit` for one member after another (the users' starting point).

    With `config["run_at_most"]`, only that many members are trained and the time is scaled
    to all of them (sequential fits cost the same per member), which keeps N=256 runs short.
    """
    _apply_threads(config)
    start = time.perf_counter()
    x, y = make_data(config["samples"])
    timed: list[float] = []
    cpu: list[float] = []
    widths = config["widths"]
    ran = widths[: config.get("run_at_most") or len(widths)]
    for i, width in enumerate(ran):
        model = build_mlp(width, seed=i)
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
        timer = epoch_timer()
        model.fit(x, y, batch_size=32, epochs=config["epochs"], verbose=0, callbacks=[timer])
        timed += _timed(timer.times, config)
        cpu += _timed(timer.cpu_times, config)
    wall = (time.perf_counter() - start) * len(widths) / len(ran)
    return {
        "wall_s": wall,
        # One member trains at a time: the aggregate rate is one fit's rate.
        **_rates(config["samples"], timed, cpu),
        "peak_rss_mib": _peak_rss_mib(),
        "note": "" if len(ran) == len(widths) else f"{len(ran)} run, time scaled",
    }


def _pool_task(args: tuple[int, int, dict[str, Any]]) -> dict[str, Any]:
    i, width, config = args
    _apply_threads(config)
    x, y = make_data(config["samples"])
    model = build_mlp(width, seed=i)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    timer = epoch_timer()
    model.fit(x, y, batch_size=32, epochs=config["epochs"], verbose=0, callbacks=[timer])
    return {"pid": os.getpid(), "timed": _timed(timer.times, config), "rss": _peak_rss_mib()}


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
        **_rates(config["samples"] * min(processes, len(tasks)), timed),
        "peak_rss_mib": _peak_rss_mib() + sum(rss_by_pid.values()),
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
    plan = pack._fusion_report
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
        **_rates(
            len(members) * config["samples"],
            _timed(timer.times, config),
            _timed(timer.cpu_times, config),
        ),
        "epoch_s": timer.times,
        "peak_rss_mib": _peak_rss_mib(),
        "engine": pack.engine,
        "note": note,
    }


def run_torch_vmap(config: dict[str, Any]) -> dict[str, float]:
    """The peer: a `torch.func` ensemble (stack_module_state + functional_call + vmap, Adam).

    Needs members of one architecture; uses the first width for all of them.
    """
    import copy

    _apply_threads(config, torch=True)
    import torch
    from torch.func import functional_call, grad_and_value, stack_module_state, vmap

    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x_np, y_np = make_data(config["samples"])
    x, y = torch.from_numpy(x_np).to(device), torch.from_numpy(y_np).to(device)
    width = config["widths"][0]
    n = len(config["widths"])

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(10, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 1),
        )

    torch.manual_seed(0)
    models = [net().to(device) for _ in range(n)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def member_loss(p, b, xb, yb):
        return loss_fn(functional_call(base, (p, b), (xb,)), yb)

    step_grads = vmap(grad_and_value(member_loss), in_dims=(0, 0, None, None))
    optimizer = torch.optim.Adam(list(params.values()), lr=1e-3)
    epoch_times, cpu_times = [], []
    for _ in range(config["epochs"]):
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(0, len(x), 32):
            grads, _ = step_grads(params, buffers, x[s : s + 32], y[s : s + 32])
            for name, p in params.items():
                p.grad = grads[name]
            optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        epoch_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        **_rates(n * config["samples"], _timed(epoch_times, config), _timed(cpu_times, config)),
        "epoch_s": epoch_times,
        "peak_rss_mib": _peak_rss_mib(),
        "threads": torch.get_num_threads(),
    }


RUNNERS = {
    "sequential": run_sequential,
    "pool": run_pool,
    "pack-graph": run_pack,
    "pack-fused": run_pack,
    "torch-vmap": run_torch_vmap,
}
