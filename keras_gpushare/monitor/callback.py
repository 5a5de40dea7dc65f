"""`UtilizationLogger`: a Keras callback that shows how busy the GPU really is."""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
import threading
import types
import warnings
import weakref
from typing import Any

import keras

from keras_gpushare.monitor import _advice, _framework, _workers
from keras_gpushare.monitor.nvml import NvmlReader
from keras_gpushare.monitor.sampler import Sampler

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 30.0

# The samplers of fits that began and whose `on_train_end` has not run, process-wide: the
# thread that ran the fit's `on_train_begin` and its stack depth there (`_stop_ended_fits`).
_running: weakref.WeakKeyDictionary[Sampler, tuple[threading.Thread, int]] = (
    weakref.WeakKeyDictionary()
)
_running_lock = threading.Lock()


class UtilizationLogger(keras.callbacks.Callback):
    """Logs GPU utilization, memory, power and temperature, sampled on a background thread.

    A daemon thread reads NVML (through `pynvml`, from the `nvidia-ml-py` package) every
    `interval` seconds; the training thread never calls NVML, it only collects the aggregates
    of the samples taken since the last time. At each epoch end these figures go into `logs`,
    so `CSVLogger`, `TensorBoard`, `History` and the progress bar show them (put this callback
    before `CSVLogger` and `TensorBoard` in the list). For every monitored device `i`:

    - `gpu{i}_util`, `gpu{i}_util_max`: mean and maximum NVML utilization (%): the share of
      time at least one kernel was running, not how many SMs it used.
    - `gpu{i}_mem_used_mib` (maximum), `gpu{i}_mem_util` (mean % of time memory was read or
      written), `gpu{i}_power_w` (mean), `gpu{i}_temp_c` (maximum).
    - `gpu{i}_sm_active`: mean share of SMs busy, from NVML GPM, on GPUs that have it (Hopper
      and newer) only.

    and `proc_gpu_mem_mib` (the most GPU memory this process held), `cpu_util` (mean host
    CPU %) and `host_mem_used_mib` (the most host memory in use). The keys are the same at
    every epoch; a figure that cannot be read is NaN. Without a GPU, driver or `pynvml`, one
    warning is logged and only the host figures are written; training is never affected.

    `gpu{i}` is the `i`-th monitored device: with `devices=None` that is CUDA's (and so the
    framework's) `GPU:i`, found through `CUDA_VISIBLE_DEVICES` (indices or UUIDs, MIG UUIDs
    included) and matched to NVML by UUID. `monitored_devices` lists the mapping.

    Under a `tf.distribute` strategy whose replicas run on GPUs, `devices=None` means the GPUs
    of the replicas on this worker only (`gpu{i}` for the replica device `GPU:i`). When
    training runs on several workers (`MultiWorkerMirroredStrategy`, or a `TF_CONFIG` that
    lists more than one task) every key starts with the worker's name, such as
    `worker1_gpu0_util` or `chief0_cpu_util`, and the log lines name the worker too.

    Args:
        interval: seconds between samples. Defaults to `0.5`.
        devices: `None` for the GPUs this process may use, or a list of NVML indices (`int`,
            as `nvidia-smi` numbers them) or UUIDs (`str`) to watch instead. Defaults to
            `None`.
        every: `"epoch"`, or an integer `k` to also write the figures of the last `k`
            batches into the batch logs every `k` batches. Defaults to `"epoch"`.
        advise: whether to log, at train end, the mean utilization and the size of a
            ModelPack that would fill the GPU (also kept in `advice`). Defaults to `True`.
        worker: `"auto"` to name the worker in the keys when training runs on several (from
            the model's strategy, else `TF_CONFIG`; kept in `worker_name`), `None` for plain
            keys always, or a name of letters, digits and underscores (e.g. `"host3"`) to
            put in front of every key. Defaults to `"auto"`.

    Example:

    ```python
    import numpy as np
    import keras
    from keras_gpushare.callbacks import UtilizationLogger

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    logger = UtilizationLogger(interval=0.1)
    history = model.fit(
        np.zeros((64, 8)), np.zeros((64, 1)), epochs=2, callbacks=[logger], verbose=0
    )
    print(history.history["cpu_util"], logger.advice)
    ```
    """

    def __init__(
        self,
        interval: float = 0.5,
        devices: list[int | str] | tuple[int | str, ...] | None = None,
        every: str | int = "epoch",
        advise: bool = True,
        worker: str | None = "auto",
    ) -> None:
        super().__init__()
        self.interval = _check_interval(interval)
        self.devices = _check_devices(devices)
        self.every = _check_every(every)
        if not isinstance(advise, bool):
            raise TypeError(
                f"Invalid type for argument `advise`: got {type(advise).__name__} "
                f"({advise!r}). Pass True or False."
            )
        self.advise = advise
        self.worker = _check_worker(worker)
        self.worker_name: str | None = None
        # Only reads aggregates under the sampler's lock, so Keras may call the batch hook
        # from its async-dispatch thread (jax, torch) without losing async dispatch.
        self.async_safe = True
        if self.every == "epoch":
            # Figures at epoch ends only: Keras's own do-nothing batch hook, so that `fit`
            # (a ModelPack's batches per compiled call, too) runs as without the logger.
            # An instance's own hook (mypy's method-assign): Keras reads the hook it finds.
            self.on_train_batch_end = types.MethodType(  # type: ignore[method-assign]
                keras.callbacks.Callback.on_train_batch_end, self
            )
        self.advice: str | None = None
        self.monitored_devices: list[dict[str, Any]] = []
        self.epoch_samples: list[dict[str, float]] = []
        self.batch_samples: list[dict[str, float]] = []
        self._sampler: Sampler | None = None
        self._batches = 0
        self._footprint: Any = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ hooks

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._stop_sampler()  # a sampler left by a fit that raised
        here, depth = threading.current_thread(), _stack_depth()
        _stop_ended_fits(here, depth)
        self.advice = None
        self.epoch_samples = []
        self.batch_samples = []
        self._batches = 0
        self._footprint = None
        strategy = _workers.model_strategy(self.model)
        if self.worker == "auto":
            self.worker_name = _workers.worker_name(strategy, os.environ.get("TF_CONFIG"))
        else:
            self.worker_name = self.worker
        probe = _framework.memory_probe(keras.backend.backend())
        reader = NvmlReader(
            self.devices,
            memory_probe=probe[0] if probe else None,
            cuda_ordinals=self._replica_ordinals(strategy) if self.devices is None else None,
        )
        if probe:
            self._footprint = probe[1]
        # The sampler holds this callback weakly and stops once it is collected.
        sampler = Sampler(reader, self.interval, windows=("epoch", "batch", "fit"), owner=self)
        sampler.start(ready_timeout=_READY_TIMEOUT_S)
        self._sampler = sampler
        with _running_lock:
            _running[sampler] = (here, depth)
        self.monitored_devices = [d.describe() for d in reader.devices]
        for d in self.monitored_devices:
            logger.info(
                self._tag("monitoring %s: NVML index %s, %s, %s"),
                d["key"],
                d["nvml_index"],
                d["name"],
                d["uuid"],
            )
            d["key"] = self._key(d["key"])
        self._drain()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if isinstance(self.every, str) or self._sampler is None:  # "epoch"
            return
        self._batches += 1
        if self._batches % self.every:
            return
        # Never wait on the training thread between batches: a window shorter than `interval`
        # reports the latest sample.
        figures, self.batch_samples = self._sampler.take("batch", wait=False)
        if logs is not None:
            logs.update(self._keyed(figures))
        self._drain()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._sampler is None:
            return
        figures, self.epoch_samples = self._sampler.take("epoch")
        if logs is not None:
            logs.update(self._keyed(figures))
        self._drain()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        sampler = self._sampler
        if sampler is None:
            return
        figures, _ = sampler.take("fit", _advice.advice_spec(sampler.reader.devices))
        self._stop_sampler()
        if self.advise:
            footprint = math.nan
            if self._footprint is not None and sampler.reader.devices:
                try:
                    footprint = float(self._footprint())
                except Exception as e:  # advice is best effort
                    logger.debug("framework peak memory unavailable: %s", e)
            self.advice = _advice.advice_text(
                sampler.reader.devices, figures, footprint, worker=self.worker_name
            )
            logger.info(self.advice)

    # ------------------------------------------------------------------ helpers

    def _replica_ordinals(self, strategy: Any) -> dict[int, int] | None:
        """`{CUDA ordinal: key}` of the GPUs the strategy's replicas on this worker use;
        `None` (every visible GPU) without a strategy or with replicas on CPUs only."""
        gpus = _workers.strategy_gpus(strategy)
        for gpu in gpus:
            logger.info(
                self._tag(
                    "a replica runs on GPU:%s: CUDA device %s, CUDA_VISIBLE_DEVICES entry %s"
                ),
                gpu.key,
                gpu.cuda_ordinal,
                gpu.visible_entry,
            )
        return {gpu.cuda_ordinal: gpu.key for gpu in gpus} or None

    def _key(self, key: str) -> str:
        return f"{self.worker_name}_{key}" if self.worker_name else key

    def _keyed(self, figures: dict[str, float]) -> dict[str, float]:
        if not self.worker_name:
            return figures
        return {self._key(key): value for key, value in figures.items()}

    def _tag(self, text: str) -> str:
        """`text` with the worker's name in front, when there is one."""
        return f"{self.worker_name}: {text}" if self.worker_name else text

    def _stop_sampler(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            with _running_lock:
                _running.pop(sampler, None)
            sampler.stop()
            self._drain(sampler)

    def _drain(self, sampler: Sampler | None = None) -> None:
        """Logs what the sampler thread handed over: notes, warnings, its exception."""
        sampler = sampler or self._sampler
        if sampler is None:
            return
        for level, text in sampler.pop_messages():
            if level >= logging.WARNING:
                if text in self._warned:
                    continue
                self._warned.add(text)
                # Shown by default, as Keras shows its own: a user who configured no
                # logging still sees that there are no GPU figures, and why.
                warnings.warn(self._tag(text), UserWarning, stacklevel=2)
            logger.log(level, "%s", self._tag(text))
        error, sampler.error = sampler.error, None
        if error is not None:
            text = f"the sampler thread failed ({type(error).__name__}: {error})"
            if text not in self._warned:
                self._warned.add(text)
                logger.warning(
                    self._tag("%s; figures are NaN from now on, training is not affected."),
                    text,
                    exc_info=(type(error), error, error.__traceback__),
                )


def _stack_depth() -> int:
    """The number of frames on the calling thread's stack, counted by that thread itself
    (as `traceback.extract_stack` does); another thread's frames are never read."""
    depth = 0
    frame = inspect.currentframe()
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def _stop_ended_fits(here: threading.Thread, depth: int) -> None:
    """Stops the samplers of fits that can no longer be running: a fit that raised never
    calls `on_train_end`, so its sampler would sample until the interpreter exits.

    A fit began on thread `t` at stack depth `d` (of its `on_train_begin`) can no longer be
    running when `t` has ended, or when `t` is the thread beginning a fit now at depth
    `depth <= d`: a fit that is still running on this thread encloses the new one (a
    callback of it calls `fit`), so the new one begins deeper. Fits on other live threads
    are left alone; a sampler whose callback was collected has stopped by itself.
    """
    with _running_lock:
        ended = [
            sampler
            for sampler, (thread, begun_at) in list(_running.items())
            if not sampler.alive or not thread.is_alive() or (thread is here and begun_at >= depth)
        ]
        for sampler in ended:
            del _running[sampler]
    for sampler in ended:
        if sampler.alive:
            logger.debug("stopping the sampler of a fit that ended without on_train_end")
        sampler.stop()


def _check_interval(interval: Any) -> float:
    if isinstance(interval, bool) or not isinstance(interval, numbers.Real):
        raise TypeError(
            f"Invalid type for argument `interval`: got {type(interval).__name__} "
            f"({interval!r}). Pass a number of seconds, e.g. `interval=0.5`."
        )
    if not math.isfinite(interval) or interval <= 0:
        raise ValueError(
            f"Invalid value for argument `interval`: got {interval!r}. Pass a positive "
            "number of seconds, e.g. `interval=0.5`."
        )
    return float(interval)


def _check_devices(devices: Any) -> list[int | str] | None:
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple)):
        raise TypeError(
            f"Invalid type for argument `devices`: got {type(devices).__name__} "
            f"({devices!r}). Pass None or a list of NVML indices or UUIDs, e.g. "
            '`devices=[0]` or `devices=["GPU-8932f937"]`.'
        )
    if not devices:
        raise ValueError(
            "Invalid value for argument `devices`: got an empty list. Pass None for the GPUs "
            "this process may use, or a list of NVML indices or UUIDs."
        )
    checked: list[int | str] = []
    for entry in devices:
        if isinstance(entry, bool) or not isinstance(entry, (numbers.Integral, str)):
            raise TypeError(
                f"Invalid type in argument `devices`: got {type(entry).__name__} "
                f"({entry!r}). Each entry must be an NVML index (int) or a UUID (str)."
            )
        if isinstance(entry, str) and not entry.strip():
            raise ValueError("Invalid value in argument `devices`: got an empty UUID string.")
        if not isinstance(entry, str) and entry < 0:
            raise ValueError(
                f"Invalid value in argument `devices`: got NVML index {entry}. Indices start "
                "at 0, as `nvidia-smi -L` lists them."
            )
        checked.append(entry.strip() if isinstance(entry, str) else int(entry))
    if len(set(checked)) != len(checked):
        raise ValueError(
            f"Invalid value for argument `devices`: got {list(devices)!r}, which names a "
            "device twice. List each device once."
        )
    return checked


def _check_worker(worker: Any) -> str | None:
    if worker is None or worker == "auto":
        return worker
    if not isinstance(worker, str):
        raise TypeError(
            f"Invalid type for argument `worker`: got {type(worker).__name__} ({worker!r}). "
            'Pass "auto", None, or a name such as "worker1".'
        )
    if not _workers.NAME_PATTERN.fullmatch(worker):
        raise ValueError(
            f'Invalid value for argument `worker`: got {worker!r}. Pass "auto", None, or a '
            'name of letters, digits and underscores that starts with a letter, such as "worker1".'
        )
    return worker


def _check_every(every: Any) -> str | int:
    if every == "epoch" and isinstance(every, str):
        return every
    if isinstance(every, bool) or not isinstance(every, numbers.Integral):
        raise TypeError(
            f"Invalid type for argument `every`: got {type(every).__name__} ({every!r}). "
            'Pass "epoch" or a positive number of batches, e.g. `every=10`.'
        )
    if every < 1:
        raise ValueError(
            f'Invalid value for argument `every`: got {every}. Pass "epoch" or a positive '
            "number of batches, e.g. `every=10`."
        )
    return int(every)
