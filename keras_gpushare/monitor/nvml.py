"""NVML access for the monitor: device discovery, UUID mapping, and readings that degrade.

`pynvml` (from the `nvidia-ml-py` package) is imported when a reader opens, never at module
import, so a machine without it, and a test that puts a stand-in module into `sys.modules`, both
work. NVML enumerates every GPU of the machine and ignores `CUDA_VISIBLE_DEVICES`, so devices
are matched to CUDA's numbering by UUID (see `_select`), never by NVML's position alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

NAN = float("nan")
_MIB = 1024.0 * 1024.0

# NVML return codes (stable since NVML 1.0). An error with one of these codes concerns one
# query on one device (a field this GPU, this driver or this user cannot read): that field
# becomes NaN for the rest of the run. Any other code means the device or the driver stopped
# answering, and GPU sampling ends.
_ERROR_INVALID_ARGUMENT = 2
_ERROR_NOT_SUPPORTED = 3
_ERROR_NO_PERMISSION = 4
_ERROR_NOT_FOUND = 6
_ERROR_FUNCTION_NOT_FOUND = 13
_FIELD_ERRORS = frozenset(
    {
        _ERROR_INVALID_ARGUMENT,
        _ERROR_NOT_SUPPORTED,
        _ERROR_NO_PERMISSION,
        _ERROR_NOT_FOUND,
        _ERROR_FUNCTION_NOT_FOUND,
    }
)

_UUID_PREFIXES = ("GPU-", "MIG-")
_FROM_ENV: Any = object()  # default of the environment-variable arguments
_CUDA_UUID_TIMEOUT_S = 30.0

# Asks the CUDA driver, in a fresh interpreter, for the UUIDs of the devices CUDA shows this
# process, in CUDA's order. A separate process keeps CUDA state out of the training process
# (a CUDA-initialized process must not fork); nvitop does the same.
_CUDA_UUIDS_SCRIPT = r"""
import ctypes, sys
try:
    cuda = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
except OSError:
    sys.exit(3)
if cuda.cuInit(0) != 0:
    sys.exit(4)
count = ctypes.c_int()
if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
    sys.exit(5)
get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
for i in range(count.value):
    device = ctypes.c_int()
    raw = (ctypes.c_ubyte * 16)()
    if cuda.cuDeviceGet(ctypes.byref(device), i) != 0 or get_uuid(raw, device) != 0:
        sys.exit(6)
    print(bytes(raw).hex())
"""


class _DeviceLostError(Exception):
    """An NVML error that is not about one field: the device or the driver is gone."""


@dataclasses.dataclass
class _Device:
    """One monitored device; `key` is `i` in the `gpu{i}_*` names."""

    key: int
    nvml_index: int | None
    uuid: str
    name: str
    handle: Any
    mig: bool = False
    disabled: set[str] = dataclasses.field(default_factory=set)
    gpm_samples: list[Any] | None = None
    gpm_primed: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "key": f"gpu{self.key}",
            "nvml_index": self.nvml_index,
            "uuid": self.uuid,
            "name": self.name,
            "mig": self.mig,
        }


@dataclasses.dataclass
class _Candidate:
    """A GPU or MIG device NVML knows, before selection."""

    nvml_index: int | None
    uuid: str
    name: str
    handle: Any
    bus_id: str = ""
    mig: bool = False
    parent_uuid: str = ""
    gi: int = -1
    ci: int = -1


class NvmlReader:
    """Reads NVML figures for the GPUs this process may use; failures become NaN, not errors.

    `open()` initializes NVML and selects the devices; when NVML cannot be used (no library,
    no driver, no permission, no GPU) `unavailable` says why and `devices` is empty. `read()`
    returns one snapshot of raw figures; a field a device cannot report is NaN for the rest of
    the run, and when a device stops answering `lost` says so and every later figure is NaN.

    Device selection follows CUDA: with `devices=None`, `CUDA_VISIBLE_DEVICES` (indices, full or
    abbreviated UUIDs, MIG UUIDs) picks and orders the devices, all GPUs when it is unset; an
    explicit `devices` list of NVML indices or UUIDs overrides it.

    Args:
        devices: `None`, or a list of NVML indices (`int`) or UUIDs (`str`, `"GPU-..."` or
            `"MIG-..."`, a unique prefix is enough). Defaults to `None`.
        cuda_visible_devices: the `CUDA_VISIBLE_DEVICES` value to apply, `None` when unset.
            Defaults to the environment's value.
        cuda_device_order: the `CUDA_DEVICE_ORDER` value. Defaults to the environment's value.
        memory_probe: a callable returning this process's GPU memory in MiB from the
            framework's allocator, used for `proc_gpu_mem_mib` when NVML's process list does
            not contain this process's PID (containers). Defaults to `None`.
        cuda_ordinals: `None`, or `{CUDA ordinal: key}`: with `devices=None`, keep only these
            of the devices CUDA shows (ordinal `i` is CUDA's `GPU:i`) and name each
            `gpu{key}`; a GPU a distribution strategy's replicas use, for example. Defaults
            to `None`.

    Example:

    ```python
    from keras_gpushare.monitor.nvml import NvmlReader

    reader = NvmlReader()
    reader.open()
    print(reader.unavailable or reader.read())
    reader.close()
    ```
    """

    def __init__(
        self,
        devices: Sequence[int | str] | None = None,
        *,
        cuda_visible_devices: str | None | object = _FROM_ENV,
        cuda_device_order: str | None | object = _FROM_ENV,
        memory_probe: Callable[[], float] | None = None,
        cuda_ordinals: Mapping[int, int] | None = None,
    ) -> None:
        if cuda_visible_devices is _FROM_ENV:
            cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        if cuda_device_order is _FROM_ENV:
            cuda_device_order = os.environ.get("CUDA_DEVICE_ORDER")
        self._requested = None if devices is None else list(devices)
        self._visible: str | None = cuda_visible_devices  # type: ignore[assignment]
        self._order = str(cuda_device_order or "FASTEST_FIRST").strip().upper()
        self._memory_probe = memory_probe
        self._ordinals = None if cuda_ordinals is None else dict(cuda_ordinals)
        self._nvml: Any = None
        self._initialized = False
        self._mem_v2 = True
        self.devices: list[_Device] = []
        self.unavailable: str | None = None
        self.lost: str | None = None
        self.notes: list[str] = []

    # ------------------------------------------------------------------ open / close

    def open(self) -> None:
        """Initializes NVML and selects the devices.

        Raises:
            ValueError: when an explicit `devices` entry names no GPU of this machine.
        """
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as e:
            self.unavailable = f"the `pynvml` module (package `nvidia-ml-py`) is missing: {e}"
            return
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            self.unavailable = f"NVML could not start ({_describe(e)})"
            return
        except (OSError, AttributeError) as e:
            self.unavailable = f"NVML could not start ({type(e).__name__}: {e})"
            return
        self._initialized = True
        try:
            candidates = self._enumerate()
            selected = self._select(candidates)
        except nvml.NVMLError as e:
            self.unavailable = f"NVML could not list the GPUs ({_describe(e)})"
            self.close()
            return
        except ValueError:
            self.close()
            raise
        keys = list(range(len(selected)))
        if self._ordinals is not None and self._requested is None and selected:
            keys, selected = self._keep_ordinals(selected, self._ordinals)
        if not selected:
            if self.unavailable is None:
                self.unavailable = "no GPU is visible to this process" + (
                    f" (CUDA_VISIBLE_DEVICES={self._visible!r})"
                    if self._visible is not None
                    else ""
                )
            self.close()
            return
        self.devices = [
            _Device(key, c.nvml_index, c.uuid, c.name, c.handle, c.mig)
            for key, c in zip(keys, selected)
        ]
        for device in self.devices:
            self._setup_gpm(device)

    def close(self) -> None:
        """Frees GPM samples and shuts NVML down; safe to call more than once."""
        nvml = self._nvml
        if nvml is None or not self._initialized:
            return
        for device in self.devices:
            for sample in device.gpm_samples or ():
                with contextlib.suppress(Exception):  # best-effort cleanup
                    nvml.nvmlGpmSampleFree(sample)
            device.gpm_samples = None
        self._initialized = False
        try:
            nvml.nvmlShutdown()
        except Exception as e:  # a vanished driver cannot be shut down
            logger.debug("nvmlShutdown failed: %s", e)

    @property
    def has_gpm(self) -> list[bool]:
        """Per device, whether NVML GPM (Hopper and newer) gives SM activity."""
        return [d.gpm_samples is not None for d in self.devices]

    # ------------------------------------------------------------------ discovery

    def _enumerate(self) -> list[_Candidate]:
        nvml = self._nvml
        candidates = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            candidate = _Candidate(
                nvml_index=index,
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                name=_text(self._optional(nvml.nvmlDeviceGetName, handle, default="GPU")),
                handle=handle,
            )
            pci = self._optional(nvml.nvmlDeviceGetPciInfo, handle, default=None)
            candidate.bus_id = _text(getattr(pci, "busId", "")).lower()
            candidates.append(candidate)
        return candidates

    def _mig_children(self, parent: _Candidate) -> list[_Candidate]:
        nvml = self._nvml
        mode = self._optional(nvml.nvmlDeviceGetMigMode, parent.handle, default=None)
        if not mode or mode[0] != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        children = []
        for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(parent.handle)):
            handle = self._optional(
                nvml.nvmlDeviceGetMigDeviceHandleByIndex, parent.handle, j, default=None
            )
            if handle is None:
                continue
            children.append(
                _Candidate(
                    nvml_index=None,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    name=f"{parent.name} MIG {j}",
                    handle=handle,
                    mig=True,
                    parent_uuid=parent.uuid,
                    gi=self._optional(nvml.nvmlDeviceGetGpuInstanceId, handle, default=-1),
                    ci=self._optional(nvml.nvmlDeviceGetComputeInstanceId, handle, default=-1),
                )
            )
        return children

    def _select(self, gpus: list[_Candidate]) -> list[_Candidate]:
        """Applies `devices`, else `CUDA_VISIBLE_DEVICES`, to NVML's list, matching by UUID."""
        if self._requested is not None:
            return [self._explicit(gpus, entry) for entry in self._requested]
        # CUDA numbers GPUs by PCI bus id with CUDA_DEVICE_ORDER=PCI_BUS_ID, and fastest first
        # otherwise; with one GPU model the two agree (ties go by bus id).
        pci_order = sorted(gpus, key=lambda c: (c.bus_id, c.nvml_index))
        entries = None if self._visible is None else self._parse_visible(self._visible)
        uses_numbers = entries is None or any(isinstance(e, int) for e in entries)
        mixed = len({c.name for c in gpus}) > 1
        if uses_numbers and mixed and self._order != "PCI_BUS_ID":
            cuda_uuids = _cuda_uuids()
            if cuda_uuids is not None:
                return self._match_cuda_uuids(gpus, cuda_uuids)
            self.notes.append(
                "GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID, and the "
                "CUDA driver could not be asked for its order: `gpu{i}` keys follow PCI bus "
                "order, which may differ from the framework's `GPU:i`. Set "
                "CUDA_DEVICE_ORDER=PCI_BUS_ID or pass `devices=` UUIDs to be sure."
            )
        if entries is None:
            return pci_order
        selected: list[_Candidate] = []
        for entry in entries:
            if isinstance(entry, int):
                match = pci_order[entry] if entry < len(pci_order) else None
            else:
                match = self._by_uuid(gpus, entry)
            if match is None:
                self.notes.append(
                    f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no GPU; CUDA ignores it "
                    "and every entry after it."
                )
                break
            if any(m.uuid == match.uuid for m in selected):
                self.notes.append(f"CUDA_VISIBLE_DEVICES lists {entry!r} twice.")
                break
            selected.append(match)
        return selected

    def _keep_ordinals(
        self, shown: list[_Candidate], ordinals: dict[int, int]
    ) -> tuple[list[int], list[_Candidate]]:
        """Applies `cuda_ordinals` to the devices CUDA shows (in CUDA's order)."""
        keys, kept = [], []
        for ordinal, key in sorted(ordinals.items(), key=lambda item: item[1]):
            if 0 <= ordinal < len(shown):
                keys.append(key)
                kept.append(shown[ordinal])
            else:
                self.notes.append(
                    f"GPU:{key} is CUDA device {ordinal}, but only {len(shown)} GPU(s) are "
                    "visible to NVML through CUDA_VISIBLE_DEVICES; it is not monitored."
                )
        if not kept and self.unavailable is None:
            self.unavailable = "no GPU of the distribution strategy's replicas is visible to NVML"
        return keys, kept

    def _parse_visible(self, text: str) -> list[int | str]:
        """Parses `CUDA_VISIBLE_DEVICES` as CUDA does: it stops at the first invalid entry."""
        entries, note = parse_cuda_visible_devices(text)
        if note is not None:
            self.notes.append(note)
        return entries

    def _explicit(self, gpus: list[_Candidate], entry: int | str) -> _Candidate:
        if isinstance(entry, int):
            for c in gpus:
                if c.nvml_index == entry:
                    return c
            raise ValueError(
                f"Invalid value for argument `devices`: NVML index {entry} does not exist; "
                f"this machine has {len(gpus)} GPU(s) (NVML indices 0..{len(gpus) - 1}). "
                "Pass NVML indices or UUIDs as `nvidia-smi -L` lists them."
            )
        match = self._by_uuid(gpus, entry)
        if match is None:
            known = ", ".join(c.uuid for c in gpus) or "none"
            raise ValueError(
                f"Invalid value for argument `devices`: {entry!r} matches no GPU UUID "
                f"(or matches several). Known GPU UUIDs: {known}. Pass a UUID or a unique "
                "prefix of one, as `nvidia-smi -L` lists them."
            )
        return match

    def _by_uuid(self, gpus: list[_Candidate], entry: str) -> _Candidate | None:
        """Finds a GPU or MIG device by full UUID, unique UUID prefix or `MIG-GPU-u/gi/ci`."""
        wanted = entry.strip()
        legacy = re.fullmatch(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)", wanted)
        if legacy:
            parent = self._by_uuid(gpus, legacy.group(1))
            if parent is None:
                return None
            gi, ci = int(legacy.group(2)), int(legacy.group(3))
            for child in self._mig_children(parent):
                if child.gi == gi and child.ci == ci:
                    return child
            return None
        pool = list(gpus)
        if wanted.upper().startswith("MIG-"):
            pool = [child for gpu in gpus for child in self._mig_children(gpu)]
        exact = [c for c in pool if c.uuid.lower() == wanted.lower()]
        if exact:
            return exact[0]
        prefixed = [c for c in pool if c.uuid.lower().startswith(wanted.lower())]
        return prefixed[0] if len(prefixed) == 1 else None

    def _match_cuda_uuids(self, gpus: list[_Candidate], cuda_uuids: list[str]) -> list[_Candidate]:
        pool = list(gpus)
        for gpu in gpus:
            pool.extend(self._mig_children(gpu))
        by_hex = {_uuid_hex(c.uuid): c for c in pool}
        selected = []
        for hex_id in cuda_uuids:
            match = by_hex.get(hex_id)
            if match is None:
                self.notes.append(f"CUDA device with UUID {hex_id} is not known to NVML.")
                continue
            selected.append(match)
        return selected

    def _setup_gpm(self, device: _Device) -> None:
        nvml = self._nvml
        if device.mig or not hasattr(nvml, "nvmlGpmQueryDeviceSupport"):
            return
        try:
            support = nvml.nvmlGpmQueryDeviceSupport(device.handle)
            if not getattr(support, "isSupportedDevice", 0):
                return
            device.gpm_samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        except nvml.NVMLError as e:
            logger.debug("GPM is not available on GPU %s: %s", device.uuid, _describe(e))

    # ------------------------------------------------------------------ readings

    def read(self, processes: bool = True) -> dict[str, float]:
        """Returns one snapshot: `gpu{i}_util`, `_mem_util`, `_mem_used_mib`, `_mem_free_mib`,
        `_mem_total_mib`, `_power_w`, `_temp_c`, `_sm_active` (GPM devices) and, with
        `processes=True`, `proc_gpu_mem_mib`. Unreadable figures are NaN."""
        figures: dict[str, float] = {}
        if self.lost is None:
            try:
                for device in self.devices:
                    self._read_device(device, figures)
                if processes and self.devices:
                    figures["proc_gpu_mem_mib"] = self._process_memory()
            except _DeviceLostError as e:
                self.lost = str(e)
        if self.lost is not None:
            figures = {key: NAN for key in self.raw_keys(processes)}
        return figures

    def raw_keys(self, processes: bool = True) -> list[str]:
        """The keys `read()` returns."""
        keys = []
        for device in self.devices:
            i = device.key
            keys += [
                f"gpu{i}_util",
                f"gpu{i}_mem_util",
                f"gpu{i}_mem_used_mib",
                f"gpu{i}_mem_free_mib",
                f"gpu{i}_mem_total_mib",
                f"gpu{i}_power_w",
                f"gpu{i}_temp_c",
            ]
            if device.gpm_samples is not None:
                keys.append(f"gpu{i}_sm_active")
        if processes and self.devices:
            keys.append("proc_gpu_mem_mib")
        return keys

    def _read_device(self, device: _Device, out: dict[str, float]) -> None:
        nvml = self._nvml
        i = device.key
        util = self._query(device, "util", nvml.nvmlDeviceGetUtilizationRates, device.handle)
        out[f"gpu{i}_util"] = _number(getattr(util, "gpu", None))
        out[f"gpu{i}_mem_util"] = _number(getattr(util, "memory", None))
        memory = self._query(device, "memory", self._memory_info, device.handle)
        out[f"gpu{i}_mem_used_mib"] = _number(getattr(memory, "used", None), _MIB)
        out[f"gpu{i}_mem_free_mib"] = _number(getattr(memory, "free", None), _MIB)
        out[f"gpu{i}_mem_total_mib"] = _number(getattr(memory, "total", None), _MIB)
        power = self._query(device, "power", nvml.nvmlDeviceGetPowerUsage, device.handle)
        out[f"gpu{i}_power_w"] = _number(power, 1000.0)
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        temp = self._query(device, "temp", nvml.nvmlDeviceGetTemperature, device.handle, sensor)
        out[f"gpu{i}_temp_c"] = _number(temp)
        if device.gpm_samples is not None:
            out[f"gpu{i}_sm_active"] = self._sm_active(device)

    def _memory_info(self, handle: Any) -> Any:
        nvml = self._nvml
        if self._mem_v2 and hasattr(nvml, "nvmlMemory_v2"):
            # v2 leaves the driver's reserved memory out of `used` (gpustat #141).
            try:
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            except nvml.NVMLError as e:
                if _code(e) not in _FIELD_ERRORS:
                    raise
                self._mem_v2 = False
            except TypeError:
                self._mem_v2 = False
        return nvml.nvmlDeviceGetMemoryInfo(handle)

    def _sm_active(self, device: _Device) -> float:
        nvml = self._nvml
        samples = device.gpm_samples
        if "gpm" in device.disabled or samples is None:
            return NAN
        if self._query(device, "gpm", nvml.nvmlGpmSampleGet, device.handle, samples[1]) is None:
            return NAN
        value = NAN
        if device.gpm_primed:
            request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = 1
            request.sample1 = samples[0]
            request.sample2 = samples[1]
            request.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
            if self._query(device, "gpm", nvml.nvmlGpmMetricsGet, request) is not None:
                metric = request.metrics[0]
                if not getattr(metric, "nvmlReturn", 0):
                    value = _number(metric.value)
        device.gpm_primed = True
        samples.reverse()  # the newest sample becomes the earlier one of the next pair
        return value

    def _process_memory(self) -> float:
        """This process's GPU memory on the monitored devices, in MiB."""
        nvml = self._nvml
        pid = os.getpid()
        total = 0.0
        found = False
        for device in self.devices:
            procs = self._query(
                device, "processes", nvml.nvmlDeviceGetComputeRunningProcesses, device.handle
            )
            for proc in procs or ():
                used = getattr(proc, "usedGpuMemory", None)
                if getattr(proc, "pid", None) == pid and used is not None:
                    total += float(used)
                    found = True
        if found:
            return total / _MIB
        # NVML reports host PIDs; inside a container this process's PID is another number.
        if self._memory_probe is not None:
            try:
                return float(self._memory_probe())
            except Exception as e:  # a framework probe must not stop sampling
                logger.debug("framework memory probe failed: %s", e)
        return NAN

    def _query(self, device: _Device, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Calls one NVML query; `None` when this field cannot be read on this device."""
        if field in device.disabled:
            return None
        nvml = self._nvml
        try:
            return fn(*args)
        except nvml.NVMLError as e:
            if _code(e) in _FIELD_ERRORS:
                device.disabled.add(field)
                logger.debug("GPU %s cannot report %s: %s", device.uuid, field, _describe(e))
                return None
            raise _DeviceLostError(
                f"GPU {device.key} ({device.name}, {device.uuid}) stopped answering NVML "
                f"({_describe(e)})"
            ) from e

    def _optional(self, fn: Callable[..., Any], *args: Any, default: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return default


def parse_cuda_visible_devices(text: str) -> tuple[list[int | str], str | None]:
    """Parses `CUDA_VISIBLE_DEVICES` as CUDA does: it stops at the first invalid entry.

    Returns the entries (indices as `int`, `GPU-`/`MIG-` UUIDs as `str`) and, when an entry
    was neither, a note saying so (`None` otherwise).
    """
    entries: list[int | str] = []
    for raw in text.split(","):
        entry = raw.strip()
        if re.fullmatch(r"\d+", entry):
            entries.append(int(entry))
        elif entry.upper().startswith(_UUID_PREFIXES):
            entries.append(entry)
        else:
            if entry and entry != "-1":
                return entries, (
                    f"CUDA_VISIBLE_DEVICES entry {entry!r} is neither an index nor a "
                    "UUID; CUDA ignores it and every entry after it."
                )
            break
    return entries, None


def _cuda_uuids() -> list[str] | None:
    """UUIDs (hex digits) of the devices CUDA shows this process, in CUDA's order."""
    try:
        result = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CUDA_UUIDS_SCRIPT],
            capture_output=True,
            text=True,
            timeout=_CUDA_UUID_TIMEOUT_S,
            env=dict(os.environ),
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("could not ask the CUDA driver for device UUIDs: %s", e)
        return None
    if result.returncode != 0:
        logger.debug("CUDA driver UUID query exited with %s", result.returncode)
        return None
    return [line.strip().lower() for line in result.stdout.splitlines() if line.strip()]


def _uuid_hex(uuid: str) -> str:
    """`GPU-8932f937-d72c-...` or `MIG-...` -> the 32 hex digits CUDA reports."""
    body = uuid[4:] if uuid.upper().startswith(_UUID_PREFIXES) else uuid
    return body.replace("-", "").lower()


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _number(value: Any, divisor: float = 1.0) -> float:
    if value is None:
        return NAN
    try:
        number = float(value) / divisor
    except (TypeError, ValueError):
        return NAN
    return number if math.isfinite(number) else NAN


def _code(error: BaseException) -> int | None:
    return getattr(error, "value", None)


def _describe(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # pynvml's __str__ itself calls NVML
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
