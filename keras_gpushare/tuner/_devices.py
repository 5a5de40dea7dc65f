"""The devices of a search over every GPU of a machine (`ParallelTuner(devices=...)`).

One worker process per entry, each pinned to its GPU through `CUDA_VISIBLE_DEVICES` before
its framework starts: CUDA then shows the worker that GPU alone (as its GPU 0), and the
monitor's NVML reader follows the same variable, so a worker's `UtilizationLogger` reports
its own GPU. An entry that names a CPU worker (`"cpu0"`) hides every GPU from its worker.
"""

from __future__ import annotations

import logging
import os
import warnings

logger = logging.getLogger("keras_gpushare.tuner")


def device_entries(devices: str | tuple[str, ...]) -> tuple[str, ...]:
    """The workers' devices: `devices` itself, or for `"all"` the GPUs CUDA shows this
    process (`CUDA_VISIBLE_DEVICES`'s entries, else every GPU NVML lists); one CPU worker,
    with a warning, where there is none."""
    if devices != "all":
        return tuple(devices)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = tuple(e.strip() for e in visible.split(",") if e.strip())
        # CUDA stops at the first invalid entry; "-1" (or nothing) shows no GPU.
        entries = tuple(e for e in entries if e != "-1")
    else:
        entries = tuple(str(i) for i in range(_nvml_gpu_count()))
    if not entries:
        warnings.warn(
            'ParallelTuner(devices="all") found no GPU on this machine: the search runs one '
            "worker process on the CPU. List CPU workers to run several "
            '(devices=["cpu0", "cpu1"]), or leave `devices` out to train in this process.',
            stacklevel=4,
        )
        entries = ("cpu0",)
    return entries


def _nvml_gpu_count() -> int:
    """The GPUs NVML lists; 0 without NVML, a driver or a GPU."""
    from keras_gpushare.monitor.nvml import NvmlReader

    reader = NvmlReader(cuda_visible_devices=None)
    try:
        reader.open()
        return len(reader.devices)
    except Exception as e:  # no library, no driver: no GPU to use
        logger.debug("NVML lists no GPU: %s", e)
        return 0
    finally:
        reader.close()


def worker_name(entry: str) -> str:
    """A device's worker: its KerasTuner tuner id (its trials' ids are `<name>-<slot>`)."""
    return entry if entry.startswith(("cpu", "GPU-", "MIG-")) else f"gpu{entry}"


def worker_environment(entry: str) -> dict[str, str]:
    """What pins a worker to `entry`: its GPU alone, or no GPU for a CPU worker."""
    return {"CUDA_VISIBLE_DEVICES": "" if entry.startswith("cpu") else entry}
