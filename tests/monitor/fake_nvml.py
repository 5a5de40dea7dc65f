"""A stand-in `pynvml` module for the monitor tests, placed in `sys.modules` by a fixture.

Every figure it returns changes from call to call and is recorded, per device, in the order
returned, so a test can check that the logged means and maxima are exactly those of the
samples NVML gave. Errors can be scheduled: `fail(uuid, function, after=n, code=c)` makes a
function raise `NVMLError(c)` from its (n+1)-th call on that device on.
"""

from __future__ import annotations

import collections
import os
import threading
import types

MIB = 1024 * 1024

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return f"fake NVML error {self.value}"


class FakeGpu:
    def __init__(self, index, uuid, name="NVIDIA H100 80GB HBM3", bus_id=None, gpm=False):
        self.index = index
        self.uuid = uuid
        self.name = name
        self.bus_id = bus_id or f"00000000:{index + 0x10:02X}:00.0"
        self.gpm = gpm
        self.total = 81559 * MIB
        self.mig_children: list[FakeGpu] = []
        self.gi = -1
        self.ci = -1
        self.parent: FakeGpu | None = None

    def add_mig(self, uuid, gi, ci):
        child = FakeGpu(-1, uuid, name=f"{self.name} MIG")
        child.gi, child.ci, child.parent = gi, ci, self
        self.mig_children.append(child)
        return child


class _Struct:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _GpmMetric:
    def __init__(self):
        self.metricId = 0
        self.nvmlReturn = 0
        self.value = 0.0


class _GpmMetricsGet:
    def __init__(self):
        self.version = 0
        self.numMetrics = 0
        self.sample1 = None
        self.sample2 = None
        self.metrics = [_GpmMetric() for _ in range(4)]


class FakeNvml:
    """Builds the fake module; `module` goes into `sys.modules["pynvml"]`."""

    def __init__(self, gpus, *, init_error=None, other_pid=4242, own_pid=None):
        self.gpus = list(gpus)
        self.init_error = init_error
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self.other_pid = other_pid
        self.lock = threading.Lock()
        self.calls = collections.Counter()
        self.returned = collections.defaultdict(lambda: collections.defaultdict(list))
        self.failures = {}
        self.inits = 0
        self.shutdowns = 0
        self.module = self._build()

    # ------------------------------------------------------------------ control

    def fail(self, uuid, function, after=0, code=NVML_ERROR_GPU_IS_LOST):
        self.failures[(uuid, function)] = (after, code)

    def values(self, uuid, field):
        with self.lock:
            return list(self.returned[uuid][field])

    # ------------------------------------------------------------------ internals

    def _count(self, gpu, function):
        with self.lock:
            key = (gpu.uuid, function)
            n = self.calls[key]
            self.calls[key] = n + 1
        failure = self.failures.get((gpu.uuid, function))
        if failure is not None and n >= failure[0]:
            raise NVMLError(failure[1])
        return n

    def _record(self, gpu, field, value):
        with self.lock:
            self.returned[gpu.uuid][field].append(value)
        return value

    def _all(self):
        for gpu in self.gpus:
            yield gpu
            yield from gpu.mig_children

    def _build(self):
        fake = self
        m = types.ModuleType("pynvml")
        m.__file__ = "<fake pynvml>"
        m.NVMLError = NVMLError
        m.NVML_TEMPERATURE_GPU = 0
        m.NVML_DEVICE_MIG_ENABLE = 1
        m.nvmlMemory_v2 = 0x02000028
        m.NVML_GPM_METRICS_GET_VERSION = 1
        m.NVML_GPM_METRIC_SM_UTIL = 2
        m.c_nvmlGpmMetricsGet_t = _GpmMetricsGet
        m.FAKE = fake

        def nvmlInit():
            if fake.init_error is not None:
                raise NVMLError(fake.init_error)
            with fake.lock:
                fake.inits += 1

        def nvmlShutdown():
            with fake.lock:
                if fake.shutdowns >= fake.inits:
                    raise NVMLError(NVML_ERROR_UNINITIALIZED)
                fake.shutdowns += 1

        def nvmlDeviceGetCount():
            return len(fake.gpus)

        def nvmlDeviceGetHandleByIndex(index):
            if not 0 <= index < len(fake.gpus):
                raise NVMLError(2)
            return fake.gpus[index]

        def nvmlDeviceGetUUID(handle):
            return handle.uuid

        def nvmlDeviceGetName(handle):
            return handle.name

        def nvmlDeviceGetPciInfo(handle):
            return _Struct(busId=handle.bus_id.encode())

        def nvmlDeviceGetMigMode(handle):
            mode = 1 if handle.mig_children else 0
            return [mode, mode]

        def nvmlDeviceGetMaxMigDeviceCount(handle):
            return 7 if handle.mig_children else 0

        def nvmlDeviceGetMigDeviceHandleByIndex(handle, index):
            if index >= len(handle.mig_children):
                raise NVMLError(6)
            return handle.mig_children[index]

        def nvmlDeviceGetGpuInstanceId(handle):
            return handle.gi

        def nvmlDeviceGetComputeInstanceId(handle):
            return handle.ci

        def nvmlDeviceGetUtilizationRates(handle):
            if handle.parent is not None:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)  # as on MIG devices
            n = fake._count(handle, "nvmlDeviceGetUtilizationRates")
            gpu = fake._record(handle, "util", (17 * n + 5 * handle.index) % 101)
            memory = fake._record(handle, "mem_util", (7 * n + 3) % 61)
            return _Struct(gpu=gpu, memory=memory)

        def nvmlDeviceGetMemoryInfo(handle, version=None):
            n = fake._count(handle, "nvmlDeviceGetMemoryInfo")
            used = fake._record(handle, "mem_used", (1000 + 37 * (n % 23)) * MIB)
            return _Struct(used=used, free=handle.total - used, total=handle.total)

        def nvmlDeviceGetPowerUsage(handle):
            n = fake._count(handle, "nvmlDeviceGetPowerUsage")
            return fake._record(handle, "power_mw", 90_000 + 1_234 * (n % 50))

        def nvmlDeviceGetTemperature(handle, sensor):
            n = fake._count(handle, "nvmlDeviceGetTemperature")
            return fake._record(handle, "temp", 40 + (n * 3) % 29)

        def nvmlDeviceGetComputeRunningProcesses(handle):
            n = fake._count(handle, "nvmlDeviceGetComputeRunningProcesses")
            own = fake._record(handle, "proc_mem", (300 + 11 * (n % 13)) * MIB)
            return [
                _Struct(pid=fake.other_pid, usedGpuMemory=5000 * MIB),
                _Struct(pid=fake.own_pid, usedGpuMemory=own),
            ]

        def nvmlGpmQueryDeviceSupport(handle):
            return _Struct(version=1, isSupportedDevice=1 if handle.gpm else 0)

        def nvmlGpmSampleAlloc():
            return _Struct(stamp=None, gpu=None)

        def nvmlGpmSampleFree(sample):
            sample.stamp = None

        def nvmlGpmSampleGet(handle, sample):
            n = fake._count(handle, "nvmlGpmSampleGet")
            sample.stamp, sample.gpu = n, handle
            return sample

        def nvmlGpmMetricsGet(request):
            a, b = request.sample1, request.sample2
            if a.stamp is None or b.stamp is None or b.stamp <= a.stamp:
                raise NVMLError(2)
            value = float((b.stamp * 13) % 97)
            request.metrics[0].value = fake._record(b.gpu, "sm_active", value)
            return request

        for name, value in list(locals().items()):
            if name.startswith("nvml"):
                setattr(m, name, value)
        return m


def h100s(n, gpm=False, name="NVIDIA H100 80GB HBM3"):
    return [
        FakeGpu(i, f"GPU-{i:08x}-1111-2222-3333-{i:012x}", name=name, gpm=gpm) for i in range(n)
    ]
