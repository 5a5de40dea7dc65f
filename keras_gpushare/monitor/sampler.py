"""The sampler thread: reads NVML and host figures every `interval` seconds into windows.

The training thread never calls NVML. It only asks for the aggregates of a window (`take`),
which closes the window and opens the next one under a lock. Windows keep running sums, maxima
and minima, so a figure is exact however long the window, plus the first samples themselves so
that the figures can be checked against what NVML returned.

Ending. `stop()` ends the thread; `on_train_end` calls it. Keras's `fit` has no `try/finally`,
so when training raises `on_train_end` never runs: the next `on_train_begin` of any callback
stops the samplers of fits that can no longer be running (`callback._stop_ended_fits`), a
sampler whose owner (the callback, held weakly) is collected stops by itself, and an `atexit`
hook stops live samplers at interpreter exit.
The thread never reads another thread's frames (`sys._current_frames()` and `f_back`):
sampling threads that do crash CPython 3.11 now and then, in its garbage collector or in
`PyFrame_GetBack` (getsentry/sentry-python#2386, DataDog/dd-trace-py#13567), and did so once
in this project's tests while this thread watched `fit`'s frame.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from collections.abc import Sequence

import psutil

from keras_gpushare.monitor.nvml import NvmlReader

logger = logging.getLogger(__name__)

NAN = float("nan")
_MIB = 1024.0 * 1024.0
_THREAD_NAME = "keras-gpushare-monitor"
_PROCESS_LIST_EVERY_S = 1.0  # NVML process lists are slow (ms) calls; nvitop uses 2 s
# Figures read less often than every sample: a window without a reading reports the last one.
_CARRIED = ("proc_gpu_mem_mib",)
_KEEP_SAMPLES = 10_000  # samples kept per window for inspection; figures never truncate
_JOIN_TIMEOUT_S = 10.0

_live: weakref.WeakSet[Sampler] = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for sampler in list(_live):
        sampler.stop(timeout=2.0)


atexit.register(_stop_all_at_exit)


class _Window:
    """Running statistics of the samples since the window opened."""

    __slots__ = ("count", "sums", "counts", "maxima", "minima", "samples")

    def __init__(self) -> None:
        self.count = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.maxima: dict[str, float] = {}
        self.minima: dict[str, float] = {}
        self.samples: list[dict[str, float]] = []

    def add(self, sample: dict[str, float]) -> None:
        self.count += 1
        if len(self.samples) < _KEEP_SAMPLES:
            self.samples.append(sample)
        for key, value in sample.items():
            if key == "t" or math.isnan(value):
                continue
            if key in self.counts:
                self.sums[key] += value
                self.counts[key] += 1
                self.maxima[key] = max(self.maxima[key], value)
                self.minima[key] = min(self.minima[key], value)
            else:
                self.sums[key] = value
                self.counts[key] = 1
                self.maxima[key] = value
                self.minima[key] = value

    def figures(
        self, spec: Sequence[tuple[str, str, str]], carried: dict[str, float] | None = None
    ) -> dict[str, float]:
        """The figures of `spec`; a raw key with no reading in this window takes its value
        from `carried` (the last reading before the window), else NaN."""
        out = {}
        for name, raw, how in spec:
            n = self.counts.get(raw, 0)
            if n == 0:
                out[name] = (carried or {}).get(raw, NAN)
            elif how == "mean":
                out[name] = self.sums[raw] / n
            elif how == "max":
                out[name] = self.maxima[raw]
            else:
                out[name] = self.minima[raw]
        return out


def figure_spec(reader: NvmlReader) -> list[tuple[str, str, str]]:
    """(logged key, raw sample key, "mean" | "max") for every figure written into `logs`."""
    spec = []
    for device, gpm in zip(reader.devices, reader.has_gpm):
        g = f"gpu{device.key}"
        spec += [
            (f"{g}_util", f"{g}_util", "mean"),
            (f"{g}_util_max", f"{g}_util", "max"),
            (f"{g}_mem_used_mib", f"{g}_mem_used_mib", "max"),
            (f"{g}_mem_util", f"{g}_mem_util", "mean"),
            (f"{g}_power_w", f"{g}_power_w", "mean"),
            (f"{g}_temp_c", f"{g}_temp_c", "max"),
        ]
        if gpm:
            spec.append((f"{g}_sm_active", f"{g}_sm_active", "mean"))
    if reader.devices:
        spec.append(("proc_gpu_mem_mib", "proc_gpu_mem_mib", "max"))
    spec += [("cpu_util", "cpu_util", "mean"), ("host_mem_used_mib", "host_mem_used_mib", "max")]
    return spec


class Sampler:
    """Samples NVML and the host on a named daemon thread and aggregates per window.

    Args:
        reader: the `NvmlReader` to open and read on the thread.
        interval: seconds between samples, timed on a monotonic clock.
        windows: names of the windows every sample goes into. Defaults to `("epoch",)`.
        owner: an object held weakly: the thread stops once it is collected. Defaults to
            `None` (only `stop()` ends the thread).

    Example:

    ```python
    from keras_gpushare.monitor.nvml import NvmlReader
    from keras_gpushare.monitor.sampler import Sampler

    sampler = Sampler(NvmlReader(), interval=0.1)
    sampler.start()
    figures, samples = sampler.take("epoch")
    sampler.stop()
    print(figures["cpu_util"], len(samples))
    ```
    """

    def __init__(
        self,
        reader: NvmlReader,
        interval: float,
        windows: Sequence[str] = ("epoch",),
        owner: object | None = None,
    ) -> None:
        self.reader = reader
        self.interval = float(interval)
        self.spec: list[tuple[str, str, str]] = figure_spec(reader)
        self._window_names = tuple(windows)
        self._windows = {name: _Window() for name in self._window_names}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._alive = False
        self._gpu_on = False
        self._gave_up = False
        self._next_process_read = 0.0
        self._cpu_times: tuple[float, float] | None = None
        self._messages: list[tuple[int, str]] = []
        self._latest: dict[str, float] | None = None
        self._carried: dict[str, float] = {}
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._owner: weakref.ref | None = None
        if owner is not None:
            # The callback sets the events only: it must not hold the sampler, nor join.
            stop, wake = self._stop, self._wake

            def owner_gone(_: object) -> None:
                stop.set()
                wake.set()

            self._owner = weakref.ref(owner, owner_gone)

    # ------------------------------------------------------------------ training-thread API

    def start(self, ready_timeout: float = 30.0) -> None:
        """Starts the thread and waits until NVML is open and the figure keys are known.

        Raises:
            ValueError: from the reader, when explicit devices name no GPU.
        """
        self._alive = True
        self._thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True)
        _live.add(self)
        self._thread.start()
        if not self._ready.wait(ready_timeout):
            self._post(
                logging.WARNING,
                f"NVML did not answer within {ready_timeout:.0f} s; logging host figures only.",
            )
            with self._cond:
                self._gave_up = True
                self._gpu_on = False
                self.spec = [s for s in self.spec if not s[0].startswith(("gpu", "proc_"))]
            return
        if isinstance(self.error, (ValueError, TypeError)):
            error, self.error = self.error, None
            self.stop()
            raise error

    def take(
        self, name: str, spec: Sequence[tuple[str, str, str]] | None = None, wait: bool = True
    ) -> tuple[dict[str, float], list[dict[str, float]]]:
        """Closes window `name` and returns its figures and its samples, opening a new one.

        A window shorter than `interval` may hold no sample. Then, with `wait=True`, the
        thread is asked for a sample now and the call waits for it (one NVML round, about a
        millisecond); with `wait=False` the latest sample stands in, without waiting. The
        process list is read at most once a second, so a window may hold no reading of
        `proc_gpu_mem_mib`: it then reports the last reading taken (the memory this process
        held is still held), and NaN only before the first reading or once the GPU is lost.
        """
        with self._cond:
            window = self._windows[name]
            if window.count == 0 and self._alive and not self._stop.is_set():
                if wait or self._latest is None:
                    self._wake.set()
                    self._cond.wait_for(
                        lambda: window.count > 0 or not self._alive,
                        timeout=max(1.0, 4 * self.interval),
                    )
                else:
                    window.add(self._latest)
            self._windows[name] = _Window()
            figures = window.figures(self.spec if spec is None else spec, self._carried)
        return figures, window.samples

    def stop(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Ends the thread and waits for it; safe to call more than once, from any thread."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout)
        _live.discard(self)

    @property
    def alive(self) -> bool:
        """Whether the thread is still sampling."""
        return self._thread is not None and self._thread.is_alive()

    def pop_messages(self) -> list[tuple[int, str]]:
        """Messages for the training thread to log: (logging level, text)."""
        with self._cond:
            messages, self._messages = self._messages, []
        return messages

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            self._open()
            self._ready.set()
            next_at = time.monotonic()
            while not self._stop.is_set():
                self._wake.clear()
                self._tick()
                next_at += self.interval
                now = time.monotonic()
                if next_at < now:  # fell behind (a slow NVML call): no burst of catch-ups
                    next_at = now
                self._wake.wait(next_at - now)
        except BaseException as e:  # handed to the training thread
            self.error = e
        finally:
            try:
                self.reader.close()
            except Exception as e:
                logger.debug("closing NVML failed: %s", e)
            with self._cond:
                self._alive = False
                self._cond.notify_all()
            self._ready.set()

    def _open(self) -> None:
        try:
            self.reader.open()
        finally:
            with self._cond:
                if not self._gave_up:
                    self.spec = figure_spec(self.reader)
                    self._gpu_on = bool(self.reader.devices)
            for note in self.reader.notes:
                self._post(logging.WARNING, note)
            if self.reader.unavailable:
                self._post(
                    logging.WARNING,
                    f"no GPU figures: {self.reader.unavailable}. Logging host figures only; "
                    "training is not affected.",
                )
            self._host_cpu()  # the first CPU reading only sets the baseline

    def _tick(self) -> None:
        sample: dict[str, float] = {"t": time.monotonic()}
        if self._gpu_on:
            processes = sample["t"] >= self._next_process_read
            if processes:
                self._next_process_read = sample["t"] + max(self.interval, _PROCESS_LIST_EVERY_S)
            sample.update(self.reader.read(processes=processes))
            if self.reader.lost is not None:
                self._gpu_on = False
                self._post(
                    logging.WARNING,
                    f"{self.reader.lost}. GPU figures are NaN from now on; host figures go on "
                    "and training is not affected.",
                )
        sample["cpu_util"] = self._host_cpu()
        sample["host_mem_used_mib"] = psutil.virtual_memory().used / _MIB
        with self._cond:
            for window in self._windows.values():
                window.add(sample)
            self._latest = sample
            if not self._gpu_on:  # GPU lost: nothing to carry
                self._carried = {}
            elif processes:
                self._carried = {key: sample[key] for key in _CARRIED if key in sample}
            self._cond.notify_all()

    def _host_cpu(self) -> float:
        """System-wide CPU busy % since the previous call, from psutil's CPU times."""
        times = psutil.cpu_times()
        total = sum(times)
        idle = times.idle + getattr(times, "iowait", 0.0)
        previous, self._cpu_times = self._cpu_times, (total, idle)
        if previous is None or total <= previous[0]:
            return NAN
        return 100.0 * (1.0 - (idle - previous[1]) / (total - previous[0]))

    def _post(self, level: int, text: str) -> None:
        with self._cond:
            self._messages.append((level, text))
