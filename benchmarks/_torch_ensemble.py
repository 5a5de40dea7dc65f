"""The torch peer of pack_vs_baselines.py: the seeds' MLPs as a `torch.func` ensemble
(stack_module_state + functional_call + vmap, one Adam over the stacked parameters)."""

from __future__ import annotations

import copy
import importlib.util
import logging
import time
from typing import Any

from keras_gpushare._seeds_benchmark.config import BenchConfig
from keras_gpushare._seeds_benchmark.measure import Run, run_config
from keras_gpushare._seeds_benchmark.workload import (
    make_data,
    peak_rss_mib,
    throughput,
    timed_epochs,
)

logger = logging.getLogger(__name__)

TORCH = "torch-vmap"


def torch_runs(config: BenchConfig, threads: tuple[int, ...]) -> list[Run]:
    """One run per member count and thread count (0: torch's default, one per core).

    Empty when torch is not installed, or when the members differ (the ensemble needs one
    architecture).
    """
    if importlib.util.find_spec("torch") is None:
        logger.info("bench: %s needs PyTorch; left out of this run", TORCH)
        return []
    if config.architecture != "same":
        logger.info("bench: %s needs one architecture; left out of this run", TORCH)
        return []
    runs: list[Run] = []
    for n in config.members:
        for count in threads:
            label = TORCH
            if len(threads) > 1:
                label += f"({count}t)" if count else "(auto)"
            runs.append((label, n, run_torch_vmap, {**run_config(config, n), "threads": count}))
    return runs


def run_torch_vmap(config: dict[str, Any]) -> dict[str, Any]:
    """Trains the members as one vmapped `torch.func` ensemble: the seeds' runner contract
    (`wall_s`, `steady_rate`, `peak_rss_mib`, ...) plus the `threads` torch used."""
    import torch
    from torch.func import functional_call, grad_and_value, stack_module_state, vmap

    if config["threads"] > 0:  # before torch starts its pool
        torch.set_num_threads(config["threads"])
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
    return {
        "wall_s": time.perf_counter() - start,
        **throughput(
            n * config["samples"],
            timed_epochs(epoch_times, config),
            timed_epochs(cpu_times, config),
        ),
        "epoch_s": epoch_times,
        "peak_rss_mib": peak_rss_mib(),
        "threads": torch.get_num_threads(),
    }
