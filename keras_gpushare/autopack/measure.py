"""What `find_pack_size` measures for one pack size: time, memory and GPU utilization.

`PackMeasurer` builds, compiles and briefly trains one pack per call and returns its
`PackSizeMeasurement`; the search (search.py) only decides which sizes to ask for.
`StepClock` is the Keras callback that times a `fit`: the first two epochs are warm-up
(tracing, XLA compilation, allocator growth, a late retrace), later epochs are timed until
at least five are and half a second has passed, or the search's deadline passes; the median
epoch gives the steady rate, so one slow epoch (another process took the CPU) does not move
it. `MemoryGauge` reads peak memory: the framework allocator's peak with a GPU (reset before
each size), this process's resident set growth on the CPU. `UtilizationGauge` samples NVML
on the monitor's sampler thread during the timed epochs only.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import psutil
from keras import tree

from keras_gpushare.autopack.result import (
    MEMORY_FRACTION,
    OK,
    OUT_OF_MEMORY,
    TIME_BUDGET,
    PackSizeMeasurement,
)
from keras_gpushare.monitor import _framework
from keras_gpushare.monitor.nvml import NvmlReader
from keras_gpushare.monitor.sampler import Sampler
from keras_gpushare.pack import ModelPack

logger = logging.getLogger(__name__)

NAN = float("nan")
_MIB = 1024.0 * 1024.0
_SAMPLE_INTERVAL_S = 0.1
WARMUP_EPOCHS = 2
_MIN_TIMED_EPOCHS = 5
_MIN_MEASURE_S = 0.5  # timed seconds per size (after the warm-up epochs)
_MAX_EPOCHS = 50
_OOM_TEXTS = ("resource_exhausted", "resourceexhausted", "out of memory", "outofmemory", "oom ")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a backend's out-of-memory error (TensorFlow, JAX/XLA, torch, host)."""
    if isinstance(error, MemoryError):
        return True
    tf = sys.modules.get("tensorflow")
    errors = getattr(tf, "errors", None)
    if errors is not None and isinstance(error, errors.ResourceExhaustedError):
        return True
    text = f"{type(error).__name__} {error}".lower()
    return any(marker in text for marker in _OOM_TEXTS)


def gpu_names() -> list[str]:
    """The GPUs the Keras backend trains on, as framework device names (empty on CPU)."""
    backend = keras.backend.backend()
    try:
        if backend == "tensorflow":
            import tensorflow as tf

            return [d.name for d in tf.config.list_logical_devices("GPU")]
        if backend == "jax":
            import jax

            return [str(d) for d in jax.local_devices() if d.platform == "gpu"]
        if backend == "torch":
            import torch

            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    except Exception as e:  # no GPU runtime is "CPU only", not an error
        logger.debug("no GPU list from %s: %s", backend, e)
    return []


class PackMeasurer:
    """Measures packs of `build_fn`'s models on `x`, `y`: one `measure(n)` per size.

    Args:
        build_fn: called as `build_fn(i)` or `build_fn()` for each member.
        x: training inputs, already cut to whole batches.
        y: training targets.
        batch_size: batch size of every member.
        compile_args: arguments of `ModelPack.compile`.
        memory_fraction: the share of the device's memory above which a size is marked
            `"memory_fraction"`.
        deadline: `time.monotonic()` value after which a `fit` stops at the next batch.
    """

    def __init__(
        self,
        build_fn: Callable[..., keras.Model],
        x: Any,
        y: Any,
        batch_size: int,
        compile_args: dict[str, Any],
        memory_fraction: float,
        deadline: float,
    ) -> None:
        self.build_fn = build_fn
        self.x = x
        self.y = y
        self.batch_size = batch_size
        self.compile_args = compile_args
        self.memory_fraction = memory_fraction
        self.deadline = deadline
        self.gpus = gpu_names()
        self.memory = MemoryGauge(self.gpus)
        self.utilization = UtilizationGauge()

    @property
    def on_gpu(self) -> bool:
        """Whether the Keras backend trains on a GPU."""
        return bool(self.gpus)

    @property
    def device(self) -> str:
        """Where the packs train, e.g. `"GPU (NVIDIA H200)"` or `"CPU"`."""
        return f"GPU ({self.utilization.device or self.gpus[0]})" if self.gpus else "CPU"

    @property
    def memory_kind(self) -> str:
        """What `memory_mib` measures."""
        return self.memory.kind

    def open(self) -> None:
        """Starts the NVML sampler (with a GPU) and learns the device's memory."""
        if self.gpus:
            self.utilization.open()
            self.memory.set_total(self.utilization.total_mib)

    def close(self) -> None:
        """Stops the NVML sampler."""
        self.utilization.close()

    def expected_share(self, last: PackSizeMeasurement, n: int) -> float:
        """The memory share `n` members would take, extrapolated linearly from `last`."""
        baseline = self.memory.baseline_mib()
        if not (math.isfinite(last.memory_mib) and math.isfinite(baseline)):
            return NAN
        growth = max(0.0, last.memory_mib - (baseline if self.gpus else 0.0))
        return self.memory.fraction(last.memory_mib + growth * (n - last.members) / last.members)

    def measure(self, n: int, fuse: str | bool = "auto") -> PackSizeMeasurement:
        """Builds, compiles and briefly trains a pack of `n`; never raises on out-of-memory.

        Args:
            n: number of members.
            fuse: `ModelPack`'s `fuse` argument.
        """
        row = PackSizeMeasurement(members=n)
        started = time.perf_counter()
        pack = None
        self.memory.start()
        clock = StepClock(
            _MIN_MEASURE_S, self.deadline, on_timing_start=self.utilization.restart_window
        )
        try:
            pack = ModelPack.from_builder(self.build_fn, n, fuse=fuse)
            row.engine = pack.engine
            pack.compile(**self.compile_args)
            row.engine = pack.engine  # compile may move a pack to another engine
            pack.fit(
                self.x,
                self.y,
                batch_size=self.batch_size,
                epochs=_MAX_EPOCHS,
                shuffle=False,
                verbose=0,
                callbacks=[clock, _RssSampler(self.memory)],
            )
            row.gpu_util = self.utilization.utilization()
            row.memory_mib = self.memory.used_mib()
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            row.status = OUT_OF_MEMORY
            row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
            logger.info("find_pack_size: %d members ran out of memory: %s", n, row.error)
        finally:
            del pack
            keras.backend.clear_session()
            gc.collect()
        row.seconds = time.perf_counter() - started
        if row.status != OK:
            return row
        row.timed_epochs = len(clock.epoch_times)
        if not clock.epoch_times:
            row.status = TIME_BUDGET
            row.error = "the time budget ran out before a timed epoch ended"
            return row
        samples = n * int(np.shape(tree.flatten(self.x)[0])[0])
        rates = [samples / t for t in clock.epoch_times]
        row.samples_per_s = samples / clock.epoch_seconds()
        row.spread = (max(rates) - min(rates)) / row.samples_per_s
        row.memory_fraction = self.memory.fraction(row.memory_mib)
        if row.memory_fraction > self.memory_fraction:
            row.status = MEMORY_FRACTION
        return row


class _RssSampler(keras.callbacks.Callback):
    """Notes the host memory at each epoch end (the CPU's peak memory)."""

    def __init__(self, gauge: MemoryGauge) -> None:
        super().__init__()
        self.gauge = gauge

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.gauge.sample()


class StepClock(keras.callbacks.Callback):
    """Times the epochs after the warm-up and stops `fit` when enough has been measured.

    Args:
        min_measure_s: timed seconds after which `fit` stops at the next epoch end (once
            five epochs are timed).
        deadline: `time.monotonic()` value after which `fit` stops at the next batch.
        on_timing_start: called when the first timed epoch begins.
    """

    def __init__(self, min_measure_s: float, deadline: float, on_timing_start: Any = None) -> None:
        super().__init__()
        self.min_measure_s = min_measure_s
        self.deadline = deadline
        self.on_timing_start = on_timing_start
        self.epoch_times: list[float] = []
        self.timed_out = False
        self._start = 0.0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.epoch_times = []
        self.timed_out = False

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == WARMUP_EPOCHS and self.on_timing_start is not None:
            self.on_timing_start()
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.model.stop_training = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        elapsed = time.perf_counter() - self._start
        if self.timed_out:
            return  # the epoch was cut short: its time is not a full epoch's
        if epoch >= WARMUP_EPOCHS:
            self.epoch_times.append(elapsed)
        timed = len(self.epoch_times) >= _MIN_TIMED_EPOCHS
        if timed and sum(self.epoch_times) >= self.min_measure_s:
            self.model.stop_training = True

    def epoch_seconds(self) -> float:
        """The median timed epoch's seconds (NaN when none was timed)."""
        return float(statistics.median(self.epoch_times)) if self.epoch_times else NAN


class MemoryGauge:
    """Peak memory of one pack size: allocator peak on a GPU, host RSS growth on the CPU."""

    def __init__(self, gpus: list[str]) -> None:
        self.gpus = gpus
        self.kind = "GPU memory peak" if gpus else "host RSS growth"
        self._process = psutil.Process()
        self._probe = _framework.memory_probe(keras.backend.backend()) if gpus else None
        self.total_mib = NAN if gpus else psutil.virtual_memory().total / _MIB
        self._baseline = 0.0
        self._peak = 0.0

    def set_total(self, total_mib: float) -> None:
        """Sets the device's memory (from NVML) that fractions refer to."""
        if self.gpus and total_mib > 0:
            self.total_mib = total_mib

    def start(self) -> None:
        """Opens a measurement: resets the allocator's peak, or notes the current RSS."""
        if self.gpus:
            self._reset_peak()
            self._baseline = self._current()
        else:
            self._baseline = self._process.memory_info().rss / _MIB
        self._peak = self._baseline

    def sample(self) -> None:
        """Notes the RSS now (the CPU's peak is the largest sample)."""
        if not self.gpus:
            self._peak = max(self._peak, self._process.memory_info().rss / _MIB)

    def used_mib(self) -> float:
        """Memory this size took: peak allocator bytes, or RSS growth since `start`."""
        if self.gpus:
            return self._peak_now()
        self.sample()
        return max(0.0, self._peak - self._baseline)

    def fraction(self, used_mib: float) -> float:
        """Share of the device's memory in use at the peak (GPU) or in this process (CPU)."""
        if not self.total_mib > 0:
            return NAN
        held = used_mib if self.gpus else self._baseline + used_mib
        return held / self.total_mib

    def baseline_mib(self) -> float:
        """Memory held before the pack was built (GPU allocator, or whole-process RSS)."""
        return self._baseline

    def _reset_peak(self) -> None:
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            for name in self.gpus:
                try:
                    tf.config.experimental.reset_memory_stats(name)
                except (ValueError, RuntimeError) as e:
                    logger.debug("cannot reset memory stats of %s: %s", name, e)
        elif keras.backend.backend() == "torch":
            import torch

            torch.cuda.reset_peak_memory_stats()

    def _current(self) -> float:
        return self._read_probe(0, "memory")

    def _peak_now(self) -> float:
        return self._read_probe(1, "peak memory")

    def _read_probe(self, index: int, what: str) -> float:
        if self._probe is None:
            return NAN
        try:
            return float(self._probe[index]())
        except Exception as e:  # memory figures are best effort
            logger.debug("framework %s probe failed: %s", what, e)
            return NAN


class UtilizationGauge:
    """NVML utilization of GPU 0 during the timed epochs, sampled off the training thread."""

    def __init__(self) -> None:
        self._sampler: Sampler | None = None
        self.device = ""
        self.total_mib = NAN
        self._key = "gpu0"

    def open(self) -> None:
        """Starts the sampler thread; without NVML or a GPU it stays closed (figures NaN)."""
        reader = NvmlReader()
        sampler = Sampler(reader, _SAMPLE_INTERVAL_S, windows=("measure",))
        try:
            sampler.start()
        except (ValueError, TypeError) as e:
            logger.warning("GPU utilization not available: %s", e)
            return
        if not reader.devices:
            sampler.stop()
            logger.info("GPU utilization not available: %s", reader.unavailable)
            return
        self._sampler = sampler
        self.device = reader.devices[0].name
        self._key = f"gpu{reader.devices[0].key}"
        figures, _ = sampler.take("measure", [("total", f"{self._key}_mem_total_mib", "max")])
        self.total_mib = figures.get("total", NAN)

    def restart_window(self) -> None:
        """Drops the samples so far: the next `utilization()` covers the time from now."""
        if self._sampler is not None:
            self._sampler.take("measure", [], wait=False)

    def utilization(self) -> float:
        """Mean NVML utilization (%) of GPU 0 since `restart_window`; NaN without NVML."""
        if self._sampler is None:
            return NAN
        figures, _ = self._sampler.take("measure", [("util", f"{self._key}_util", "mean")])
        value = figures.get("util", NAN)
        return value if value is not None and not math.isnan(value) else NAN

    def close(self) -> None:
        """Stops the sampler thread."""
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()
