"""The devices of a search over every GPU of a machine (`ParallelTuner(devices=...)`).

One worker process per entry, each pinned to its GPU through `CUDA_VISIBLE_DEVICES` before
its framework starts: CUDA then shows the worker that GPU alone (as its GPU 0), and the
monitor's NVML reader follows the same variable, so a worker's `UtilizationLogger` reports
its own GPU. An entry that names a CPU worker (`"cpu0"`) hides every GPU from its worker.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Sequence

logger = logging.getLogger("keras_gpushare.tuner")

_CPU_WORKER = re.compile(r"cpu\d+", re.IGNORECASE)
_GPU_INDEX = re.compile(r"(?:gpu)?(\d+)", re.IGNORECASE)
_UUID_PREFIXES = ("GPU-", "MIG-")


def entry_of(device: str | int) -> str | None:
    """One `devices` entry as the tuner keeps it: a GPU index (`3`, `"3"` or `"gpu3"` give
    `"3"`), a GPU or MIG UUID (or a unique prefix of one), or a CPU worker (`"cpu0"`);
    None for anything else."""
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        return None
    text = str(device).strip()
    index = _GPU_INDEX.fullmatch(text)
    if index is not None:
        return str(int(index.group(1)))
    if _CPU_WORKER.fullmatch(text):
        return text.lower()
    if text.upper().startswith(_UUID_PREFIXES) and len(text) > 4 and "," not in text:
        return text
    return None


def check_gpus(entries: Sequence[str]) -> None:
    """Checks each GPU entry against the GPUs NVML lists, before any worker starts: an
    entry naming none of them is a `ValueError` listing those there are; with no GPU at
    all (no NVML, no driver), one warning says that their workers train on the CPU. CPU
    workers (`"cpu0"`) are not checked."""
    gpu_entries = [e for e in entries if not _CPU_WORKER.fullmatch(e)]
    if not gpu_entries:
        return
    gpus, why = _nvml_gpus()
    if not gpus:
        workers = ", ".join(worker_name(e) for e in gpu_entries)
        warnings.warn(
            f"ParallelTuner(devices={list(entries)}) found no GPU on this machine ({why}): "
            f"worker{'s' if len(gpu_entries) > 1 else ''} {workers} will train on the CPU. "
            'Name CPU workers (devices=["cpu0", "cpu1"]) to train there without this '
            "warning, or leave `devices` out to train in this process.",
            stacklevel=4,
        )
        return
    for entry in gpu_entries:
        if not _names_a_gpu(entry):
            listed = "; ".join(f"{i}: {uuid} ({name})" for i, uuid, name in gpus)
            missing = (
                f"there is no GPU {entry} on this machine"
                if entry.isdigit()
                else f"no GPU of this machine has UUID {entry!r} (nor one alone starts with it)"
            )
            raise ValueError(
                f"Invalid value for argument `devices`: {missing}. Its GPUs (index: UUID) "
                f"are {listed}. Pass indices or UUIDs (a unique prefix is enough) of these, "
                'or "cpu0", "cpu1", ... for workers on the CPU.'
            )


def _nvml_gpus() -> tuple[list[tuple[int, str, str]], str]:
    """The GPUs NVML lists, as (index, UUID, name) in index order; none, and why, without
    NVML, a driver or a GPU."""
    from keras_gpushare.monitor.nvml import NvmlReader

    reader = NvmlReader(cuda_visible_devices=None)
    try:
        reader.open()
    except Exception as e:  # no library, no driver: no GPU to use
        logger.debug("NVML lists no GPU: %s", e)
        return [], f"NVML: {e}"
    finally:
        reader.close()
    gpus = [(d.nvml_index or 0, d.uuid, d.name) for d in reader.devices]
    return sorted(gpus), reader.unavailable or ""


def _names_a_gpu(entry: str) -> bool:
    """Whether NVML finds `entry` (an index, a GPU or MIG UUID or a unique prefix)."""
    from keras_gpushare.monitor.nvml import NvmlReader

    reader = NvmlReader([int(entry) if entry.isdigit() else entry], cuda_visible_devices=None)
    try:
        reader.open()
    except ValueError:
        return False
    finally:
        reader.close()
    return bool(reader.devices)


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
        entries = tuple(str(i) for i in range(len(_nvml_gpus()[0])))
    if not entries:
        warnings.warn(
            'ParallelTuner(devices="all") found no GPU on this machine: the search runs one '
            "worker process on the CPU. List CPU workers to run several "
            '(devices=["cpu0", "cpu1"]), or leave `devices` out to train in this process.',
            stacklevel=4,
        )
        entries = ("cpu0",)
    return entries


def worker_name(entry: str) -> str:
    """A device's worker: its KerasTuner tuner id (its trials' ids are `<name>-<slot>`):
    `gpu3` for GPU index `3`, the entry itself for a UUID or a CPU worker."""
    return f"gpu{entry}" if entry.isdigit() else entry


def worker_environment(entry: str) -> dict[str, str]:
    """What pins a worker to `entry`: its GPU alone, or no GPU for a CPU worker."""
    return {"CUDA_VISIBLE_DEVICES": "" if entry.startswith("cpu") else entry}
