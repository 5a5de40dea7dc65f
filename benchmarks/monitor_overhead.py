"""What UtilizationLogger costs a training step: ratios against a same-run baseline.

Trains one small Keras MLP, sized so a step takes about `--step-ms` (5 ms by default), with no
callback (the baseline) and with UtilizationLogger in a few settings, interleaved over
`--repeats` rounds, and prints the median step time of each setting and its ratio to the
baseline of the same round. Epoch 0 (compilation) is left out; the span timed covers the
other epochs, our epoch-end work included. It also prints the CPU time the sampler thread
itself used, as a share of the time timed, which does not depend on run-to-run noise.

NVML: `--nvml real` uses the machine's NVML, `--nvml fake` a stand-in `pynvml` module whose
calls sleep as long as real ones (sleeping releases the GIL, as real ctypes calls do; Linux
sleeps at least ~50 us, so short calls are overestimated), and `auto` (the default) uses the
real one when a GPU answers. Works with any Keras backend; TensorFlow is not needed.

    python benchmarks/monitor_overhead.py
    KERAS_BACKEND=jax python benchmarks/monitor_overhead.py --nvml real --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import types

import numpy as np

# Seconds one call takes, from measurements reported in MangoHud PR #2104 (RTX 4090, driver
# 610): utilization 2.5 us, memory 11.6 us, process list 4.5 ms (graphics; we ask the
# compute list, taken as the same). Power, temperature and GPM: assumed.
_CALL_SECONDS = {
    "nvmlDeviceGetUtilizationRates": 2.5e-6,
    "nvmlDeviceGetMemoryInfo": 11.6e-6,
    "nvmlDeviceGetPowerUsage": 20e-6,
    "nvmlDeviceGetTemperature": 20e-6,
    "nvmlDeviceGetComputeRunningProcesses": 4.5e-3,
    "nvmlGpmSampleGet": 100e-6,
    "nvmlGpmMetricsGet": 20e-6,
}


def _sleepy_nvml() -> types.ModuleType:
    """A stand-in `pynvml`: one H100 with GPM whose calls sleep like real ones."""

    class NVMLError(Exception):
        value = 999

    class _Obj:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _MetricsGet:
        def __init__(self):
            self.metrics = [_Obj(metricId=0, nvmlReturn=0, value=0.0)]

    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_TEMPERATURE_GPU = 0
    m.NVML_GPM_METRICS_GET_VERSION = 1
    m.NVML_GPM_METRIC_SM_UTIL = 2
    m.c_nvmlGpmMetricsGet_t = _MetricsGet
    gpu = _Obj(uuid="GPU-00000000-0000-0000-0000-000000000000")

    def sleeper(name, result):
        seconds = _CALL_SECONDS.get(name, 0.0)

        def call(*args, **kwargs):
            if seconds:
                time.sleep(seconds)
            return result(*args) if callable(result) else result

        return call

    own_pid = os.getpid()
    functions = {
        "nvmlInit": None,
        "nvmlShutdown": None,
        "nvmlDeviceGetCount": 1,
        "nvmlDeviceGetHandleByIndex": gpu,
        "nvmlDeviceGetUUID": gpu.uuid,
        "nvmlDeviceGetName": "NVIDIA H100 (stand-in)",
        "nvmlDeviceGetPciInfo": _Obj(busId=b"00000000:01:00.0"),
        "nvmlDeviceGetMigMode": [0, 0],
        "nvmlDeviceGetUtilizationRates": _Obj(gpu=42, memory=17),
        "nvmlDeviceGetMemoryInfo": _Obj(used=2 << 30, free=78 << 30, total=80 << 30),
        "nvmlDeviceGetPowerUsage": 250_000,
        "nvmlDeviceGetTemperature": 45,
        "nvmlDeviceGetComputeRunningProcesses": [_Obj(pid=own_pid, usedGpuMemory=1 << 30)],
        "nvmlGpmQueryDeviceSupport": _Obj(isSupportedDevice=1),
        "nvmlGpmSampleAlloc": lambda: _Obj(),
        "nvmlGpmSampleFree": None,
        "nvmlGpmSampleGet": lambda device, sample: sample,
        "nvmlGpmMetricsGet": lambda request: request,
    }
    for name, result in functions.items():
        setattr(m, name, sleeper(name, result))
    return m


def _real_nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


class _EpochTimer:
    """Times epochs 1.. and reads the sampler thread's CPU time (a Keras callback)."""

    def __new__(cls):
        import keras
        import psutil

        class Timer(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.start = None
                self.span = 0.0
                self.sampler_cpu = 0.0

            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:
                    self.start = time.perf_counter()
                    self.cpu0 = self._sampler_cpu()

            def on_epoch_end(self, epoch, logs=None):
                if epoch == self.params["epochs"] - 1:
                    self.span = time.perf_counter() - self.start
                    self.sampler_cpu = self._sampler_cpu() - self.cpu0

            @staticmethod
            def _sampler_cpu():
                ids = {
                    t.native_id for t in threading.enumerate() if t.name == "keras-gpushare-monitor"
                }
                return sum(
                    t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids
                )

        return Timer()


def _model(width: int):
    import keras

    model = keras.Sequential(
        [
            keras.Input((width,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def _data(width: int, steps: int, batch: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, width)).astype("float32")
    return x, x[:, :1].copy()


def _step_ms(model, x, y, batch: int, epochs: int, callbacks) -> tuple[float, float, float]:
    """(ms per step, sampler CPU share, hook time share) over epochs 1.. of one fit."""
    timer = _EpochTimer()
    hooks = [type(c) for c in callbacks if hasattr(type(c), "hook_seconds")]
    for cls in hooks:
        cls.hook_seconds = 0.0
    model.fit(x, y, batch_size=batch, epochs=epochs, callbacks=[*callbacks, timer], verbose=0)
    steps = (epochs - 1) * (len(x) // batch)
    # hook time of epoch 0 is included: an upper bound
    hook_share = sum(cls.hook_seconds for cls in hooks) / timer.span
    return 1000.0 * timer.span / steps, timer.sampler_cpu / timer.span, hook_share


def _calibrate(target_ms: float, batch: int) -> int:
    """The width (steps of about 1.4x) whose step time is closest to `target_ms`."""
    best, best_gap = 32, float("inf")
    for k in range(19):
        width = int(32 * 2 ** (k / 2)) // 8 * 8
        model = _model(width)
        x, y = _data(width, 50, batch)
        _step_ms(model, x, y, batch, 2, [])  # compile and warm up first
        ms, _, _ = _step_ms(model, x, y, batch, 3, [])
        print(f"  calibration: width {width:>5}: {ms:6.2f} ms/step", flush=True)
        if abs(ms - target_ms) < best_gap:
            best, best_gap = width, abs(ms - target_ms)
        if ms >= target_ms:
            break
    return best


def _timed_logger_class(base):
    """UtilizationLogger that adds up the time its hooks take on the training thread."""

    class Timed(base):
        hook_seconds = 0.0

        def _timed(self, hook, *args, **kwargs):
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                type(self).hook_seconds += time.perf_counter() - start

        def on_train_batch_end(self, batch, logs=None):
            self._timed(super().on_train_batch_end, batch, logs)

        def on_epoch_end(self, epoch, logs=None):
            self._timed(super().on_epoch_end, epoch, logs)

    return Timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvml", choices=("auto", "real", "fake"), default="auto")
    parser.add_argument("--step-ms", type=float, default=5.0, help="target step time (5)")
    parser.add_argument("--width", type=int, default=None, help="MLP width (calibrated)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="steps per epoch (200)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per fit, first untimed")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (5)")
    args = parser.parse_args(argv)

    nvml = args.nvml
    if nvml == "auto":
        nvml = "real" if _real_nvml_works() else "fake"
    if nvml == "fake":
        sys.modules["pynvml"] = _sleepy_nvml()
    elif not _real_nvml_works():
        print("monitor_overhead: --nvml real, but NVML has no GPU here.", file=sys.stderr)
        return 1

    import keras

    from keras_gpushare.callbacks import UtilizationLogger

    utilization_logger = _timed_logger_class(UtilizationLogger)
    print(f"backend {keras.backend.backend()}, NVML {nvml}", flush=True)
    width = args.width or _calibrate(args.step_ms, args.batch)
    model = _model(width)
    x, y = _data(width, args.steps, args.batch)
    configs = {
        "baseline (no callback)": lambda: [],
        "UtilizationLogger()": lambda: [utilization_logger(advise=False)],
        "UtilizationLogger(interval=0.05)": lambda: [
            utilization_logger(interval=0.05, advise=False)
        ],
        "UtilizationLogger(every=10)": lambda: [utilization_logger(every=10, advise=False)],
    }
    _step_ms(model, x, y, args.batch, 2, [])  # compile and warm up
    times = {name: [] for name in configs}
    cpu = {name: [] for name in configs}
    hooks = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            ms, share, hook_share = _step_ms(model, x, y, args.batch, args.epochs, configs[name]())
            times[name].append(ms)
            cpu[name].append(share)
            hooks[name].append(hook_share)
    base = times[names[0]]
    print(
        f"\nwidth {width}, batch {args.batch}, {args.steps} steps x {args.epochs - 1} timed "
        f"epochs, {args.repeats} interleaved rounds"
    )
    print(
        f"{'setting':<34} {'ms/step':>8} {'ratio':>7} {'min ratio':>9} {'sampler CPU':>12} "
        f"{'hooks':>8} {'estimate':>9}"
    )
    for name in names:
        ratio = statistics.median(t / b for t, b in zip(times[name], base))
        min_ratio = min(times[name]) / min(base)
        sampler = 100 * statistics.median(cpu[name])
        hook = 100 * statistics.median(hooks[name])
        print(
            f"{name:<34} {statistics.median(times[name]):8.3f} {ratio:7.3f} {min_ratio:9.3f} "
            f"{sampler:11.3f}% {hook:7.3f}% {sampler + hook:8.3f}%"
        )
    print(
        "\nratio: median over rounds of (setting / baseline of the same round), noisy on a "
        "busy machine;\nmin ratio: fastest run / fastest baseline run, less sensitive to "
        "other load;\nsampler CPU: the sampler thread's CPU time / time timed (psutil, 10 ms "
        "ticks); hooks: time in our\nhooks on the training thread / time timed; estimate: "
        "their sum, what the training thread can lose."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
