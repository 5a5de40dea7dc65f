"""`find_pack_size`: how many models to train at once on this machine."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import logging
import math
import numbers
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import tree

from keras_gpushare import _autopack_measure as measure
from keras_gpushare.pack import ModelPack

logger = logging.getLogger(__name__)

NAN = float("nan")
OK = "ok"
OUT_OF_MEMORY = "out_of_memory"
MEMORY_FRACTION = "memory_fraction"
TIME_BUDGET = "time_budget"
PLATEAU = "plateau"
MAX_MEMBERS = "max_members"

_MAX_BATCHES = 64  # batches per epoch: enough for steady state, short enough for many sizes
_MIN_MEASURE_S = 0.5  # timed seconds per size (after the warm-up epoch)
_MAX_EPOCHS = 50
_DEFAULT_COMPILE = {"optimizer": "adam", "loss": "mse"}


@dataclasses.dataclass
class PackSizeMeasurement:
    """One row of `find_pack_size`'s table: a pack of `members` models, trained briefly.

    Attributes:
        members: number of models in the pack.
        status: `"ok"`, `"out_of_memory"`, `"memory_fraction"` (ran, but above the limit)
            or `"time_budget"` (stopped before a full timed epoch).
        engine: `"fused"` or `"graph"` (empty when the pack could not be built).
        samples_per_s: steady-state aggregate throughput, model-samples per second (each
            member's samples counted); NaN when not measured.
        memory_mib: peak GPU memory of the framework's allocator, or with no GPU the growth
            of this process's resident memory; NaN when not measured.
        memory_fraction: share of the device's memory (GPU) or the host's (CPU) in use at
            the peak; NaN when unknown.
        gpu_util: mean NVML utilization (%) of GPU 0 during the timed epochs; NaN without
            a GPU.
        seconds: wall time this size took, building and warm-up included.
        error: the error text when `status` is not `"ok"`.
    """

    members: int
    status: str = OK
    engine: str = ""
    samples_per_s: float = NAN
    memory_mib: float = NAN
    memory_fraction: float = NAN
    gpu_util: float = NAN
    seconds: float = NAN
    error: str = ""

    @property
    def per_member(self) -> float:
        """Throughput of each member: `samples_per_s / members`."""
        return self.samples_per_s / self.members


@dataclasses.dataclass
class PackSizeResult:
    """What `find_pack_size` found: the size to use, the measurements, and why it stopped.

    Attributes:
        pack_size: the suggested number of members.
        reason: why the search stopped, in words.
        stopped_by: `"plateau"`, `"out_of_memory"`, `"memory_fraction"`, `"time_budget"`
            or `"max_members"`.
        measurements: one `PackSizeMeasurement` per size tried, in order.
        device: where it ran, e.g. `"GPU (NVIDIA H200)"` or `"CPU"`.
        memory_kind: what `memory_mib` measures: `"GPU memory peak"` or
            `"host RSS growth"`.
    """

    pack_size: int
    reason: str
    stopped_by: str
    measurements: list[PackSizeMeasurement]
    device: str
    memory_kind: str

    def table(self) -> str:
        """The measurements as a text table."""
        lines = [
            f"{'members':>7}  {'engine':<6} {'model-samples/s':>15} {'per member':>11} "
            f"{'gain':>6} {'memory MiB':>10} {'memory %':>8} {'GPU util %':>10} "
            f"{'seconds':>7}  status"
        ]
        previous = None
        for row in self.measurements:
            gain = "-"
            if previous is not None and row.status == OK:
                gain = f"{row.samples_per_s / previous.samples_per_s:.2f}x"
            lines.append(
                f"{row.members:>7}  {row.engine or '-':<6} {_fmt(row.samples_per_s, ',.0f'):>15} "
                f"{_fmt(row.per_member, ',.0f'):>11} {gain:>6} {_fmt(row.memory_mib, ',.1f'):>10} "
                f"{_fmt(100 * row.memory_fraction, '.1f'):>8} {_fmt(row.gpu_util, '.0f'):>10} "
                f"{_fmt(row.seconds, '.1f'):>7}  {row.status.replace('_', ' ')}"
            )
            if row.status == OK:
                previous = row
        return "\n".join(lines)

    def __str__(self) -> str:
        return (
            f"find_pack_size on {self.device} (memory: {self.memory_kind})\n"
            f"{self.table()}\n"
            f"suggested pack size: {self.pack_size} ({self.reason})"
        )


def find_pack_size(
    build_fn: Callable[..., keras.Model],
    x: Any,
    y: Any,
    batch_size: int,
    max_members: int = 256,
    memory_fraction: float = 0.9,
    time_budget_s: float = 60,
    *,
    compile_kwargs: dict[str, Any] | None = None,
    min_gain: float = 0.1,
    progress: Callable[[PackSizeMeasurement], None] | None = None,
) -> PackSizeResult:
    """Finds how many models to pack together for the best throughput on this machine.

    Trains short packs of 1, 2, 4, 8, ... members (`ModelPack.from_builder(build_fn, n)`,
    fused where the members allow it) on up to 64 batches of `x`, `y`: two warm-up epochs
    (tracing, compilation), then at least three timed epochs and half a second. For each size
    it records the steady-state aggregate throughput (model-samples per second, from the
    median timed epoch), the peak memory
    (the framework allocator's peak with a GPU, this process's resident memory growth
    without) and, with a GPU, NVML utilization during the timed epochs.

    The search stops when doubling the pack gives less than `min_gain` more throughput, when
    a size runs out of memory (the error is caught and the session cleared), when the peak
    memory passes `memory_fraction` of the device (or the next size would), when the time
    budget is spent, or at `max_members`. The suggested size is the last one that still added
    throughput within the limits.

    Args:
        build_fn: function returning a new `keras.Model`, called as `build_fn(i)` for member
            `i` when it takes an argument, else `build_fn()`.
        x: training inputs (array, or a structure of arrays with the same first dimension).
        y: training targets, as for `keras.Model.fit`.
        batch_size: batch size of every member.
        max_members: the largest pack to try. Defaults to `256`.
        memory_fraction: the share of the device's memory a pack may use at its peak (with no
            GPU: of the host's memory, this process included). Defaults to `0.9`.
        time_budget_s: seconds the whole search may take; a size that would start too late
            is not tried. Defaults to `60`.
        compile_kwargs: arguments of `ModelPack.compile`. Defaults to `None`, meaning
            `{"optimizer": "adam", "loss": "mse"}` (keys given replace these).
        min_gain: the relative throughput gain a doubled pack must bring to go on
            (`0.1`: 10% more model-samples per second). Defaults to `0.1`.
        progress: called with each `PackSizeMeasurement` as soon as it is taken (the
            command line prints a line per size with it). Defaults to `None`.

    Returns:
        A `PackSizeResult`; `str(result)` is the table and the suggestion.

    Example:

    ```python
    import numpy as np
    import keras
    import keras_gpushare as kg

    def build():
        return keras.Sequential(
            [keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
             keras.layers.Dense(1)]
        )

    x = np.random.rand(1024, 10).astype("float32")
    y = np.random.rand(1024, 1).astype("float32")
    result = kg.find_pack_size(build, x, y, batch_size=32, max_members=4, time_budget_s=30)
    print(result)              # the table and "suggested pack size: ..."
    print(result.pack_size)
    ```
    """
    _check_builder(build_fn)
    rows = _check_data(x, y, batch_size)
    max_members = _check_positive_int(max_members, "max_members", "e.g. `max_members=64`")
    memory_fraction = _check_fraction(memory_fraction)
    time_budget_s = _check_positive_number(time_budget_s, "time_budget_s", "`time_budget_s=60`")
    min_gain = _check_min_gain(min_gain)
    compile_args = _check_compile_kwargs(compile_kwargs)
    if progress is not None and not callable(progress):
        raise TypeError(
            f"Invalid type for argument `progress`: got {type(progress).__name__}. Pass a "
            "function taking a PackSizeMeasurement, or None."
        )
    x_fit = tree.map_structure(lambda a: a[:rows], x)
    y_fit = tree.map_structure(lambda a: a[:rows], y)

    search = _Search(
        build_fn, x_fit, y_fit, batch_size, compile_args, memory_fraction, time_budget_s
    )
    return search.run(_sizes(max_members), min_gain, progress)


class _Search:
    """The doubling search; holds the gauges and the clock shared by every size."""

    def __init__(
        self,
        build_fn: Callable[..., keras.Model],
        x: Any,
        y: Any,
        batch_size: int,
        compile_args: dict[str, Any],
        memory_fraction: float,
        time_budget_s: float,
    ) -> None:
        self.build_fn = build_fn
        self.x = x
        self.y = y
        self.batch_size = batch_size
        self.compile_args = compile_args
        self.memory_fraction = memory_fraction
        self.start = time.monotonic()
        self.deadline = self.start + time_budget_s
        self.gpus = measure.gpu_names()
        self.memory = measure.MemoryGauge(self.gpus)
        self.utilization = measure.UtilizationGauge()

    def run(
        self,
        sizes: list[int],
        min_gain: float,
        progress: Callable[[PackSizeMeasurement], None] | None,
    ) -> PackSizeResult:
        rows: list[PackSizeMeasurement] = []
        chosen: PackSizeMeasurement | None = None
        stopped_by, reason = MAX_MEMBERS, f"reached max_members={sizes[-1]}"
        if self.gpus:
            self.utilization.open()
            self.memory.set_total(self.utilization.total_mib)
        try:
            for n in sizes:
                early = self._stop_before(n, chosen)
                if early is not None:
                    stopped_by, reason = early
                    break
                row = self._measure(n)
                rows.append(row)
                logger.info("find_pack_size: %s", row)
                if progress is not None:
                    progress(row)
                if row.status != OK:
                    stopped_by = row.status
                    reason = _failure_reason(row, self.memory_fraction)
                    break
                if chosen is not None and row.samples_per_s < (1 + min_gain) * (
                    chosen.samples_per_s
                ):
                    stopped_by = PLATEAU
                    reason = (
                        f"throughput stopped growing: {n} members gave "
                        f"{row.samples_per_s / chosen.samples_per_s:.2f}x the model-samples/s "
                        f"of {chosen.members}, below the {1 + min_gain:.2f}x asked for"
                    )
                    break
                chosen = row
                if time.monotonic() > self.deadline:
                    stopped_by, reason = TIME_BUDGET, "the time budget is spent"
                    break
        finally:
            self.utilization.close()
        if chosen is None:
            reason += "; no pack size could be measured, so 1 is suggested"
        device = f"GPU ({self.utilization.device or self.gpus[0]})" if self.gpus else "CPU"
        return PackSizeResult(
            pack_size=chosen.members if chosen is not None else 1,
            reason=reason,
            stopped_by=stopped_by,
            measurements=rows,
            device=device,
            memory_kind=self.memory.kind,
        )

    def _stop_before(self, n: int, last: PackSizeMeasurement | None) -> tuple[str, str] | None:
        """Why size `n` should not be tried (time or memory it would need), or None."""
        if last is None:
            return None
        left = self.deadline - time.monotonic()
        if left < last.seconds:
            return (
                TIME_BUDGET,
                f"time budget: {n} members would take at least the {last.seconds:.1f} s "
                f"that {last.members} took, and {max(left, 0.0):.1f} s are left",
            )
        baseline = self.memory.baseline_mib()
        if math.isfinite(last.memory_mib) and math.isfinite(baseline):
            growth = max(0.0, last.memory_mib - (baseline if self.gpus else 0.0))
            expected = last.memory_mib + growth * (n - last.members) / last.members
            share = self.memory.fraction(expected)
            if share > self.memory_fraction:
                return (
                    MEMORY_FRACTION,
                    f"memory: {n} members would need about {100 * share:.0f}% of the "
                    f"{'GPU' if self.gpus else 'host'} memory, above memory_fraction="
                    f"{self.memory_fraction}",
                )
        return None

    def _measure(self, n: int) -> PackSizeMeasurement:
        """Builds, compiles and briefly trains a pack of `n`; never raises on out-of-memory."""
        row = PackSizeMeasurement(members=n)
        started = time.perf_counter()
        pack = None
        self.memory.start()
        clock = measure.StepClock(
            _MIN_MEASURE_S, self.deadline, on_timing_start=self.utilization.restart_window
        )
        try:
            pack = ModelPack.from_builder(self.build_fn, n, fuse="auto")
            row.engine = pack.engine
            pack.compile(**self.compile_args)
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
            if not measure.is_out_of_memory(e):
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
        if not clock.epoch_times:
            row.status = TIME_BUDGET
            row.error = "the time budget ran out before a timed epoch ended"
            return row
        rows = _first_dim(self.x)
        row.samples_per_s = n * rows / clock.epoch_seconds()
        row.memory_fraction = self.memory.fraction(row.memory_mib)
        if row.memory_fraction > self.memory_fraction:
            row.status = MEMORY_FRACTION
        return row


class _RssSampler(keras.callbacks.Callback):
    """Notes the host memory at each epoch end (the CPU's peak memory)."""

    def __init__(self, gauge: measure.MemoryGauge) -> None:
        super().__init__()
        self.gauge = gauge

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.gauge.sample()


def _failure_reason(row: PackSizeMeasurement, memory_fraction: float) -> str:
    if row.status == OUT_OF_MEMORY:
        return f"out of memory at {row.members} members ({row.error})"
    if row.status == MEMORY_FRACTION:
        return (
            f"memory: {row.members} members used {100 * row.memory_fraction:.0f}% of the "
            f"memory, above memory_fraction={memory_fraction}"
        )
    return f"time budget: spent while measuring {row.members} members"


def _sizes(max_members: int) -> list[int]:
    sizes = []
    n = 1
    while n < max_members:
        sizes.append(n)
        n *= 2
    sizes.append(max_members)
    return sizes


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _first_dim(data: Any) -> int:
    return int(np.shape(tree.flatten(data)[0])[0])


def _check_builder(build_fn: Any) -> None:
    if not callable(build_fn):
        raise TypeError(
            f"Invalid value for argument `build_fn`: got {type(build_fn).__name__}. Pass a "
            "function returning a new keras.Model, such as `lambda i: make_model()`."
        )
    try:
        params = [
            p
            for p in inspect.signature(build_fn).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return
    if len(params) > 1:
        raise TypeError(
            f"Invalid value for argument `build_fn`: {getattr(build_fn, '__name__', build_fn)} "
            f"takes {len(params)} required arguments ({', '.join(p.name for p in params)}). "
            "It is called as build_fn(i) or build_fn(); bind the others, e.g. "
            "`lambda i: build(64, seed=i)`."
        )


def _check_data(x: Any, y: Any, batch_size: Any) -> int:
    """Checks the data and the batch size; returns the rows to train on per epoch."""
    batch_size = _check_positive_int(batch_size, "batch_size", "e.g. `batch_size=32`")
    sizes = set()
    for name, data in (("x", x), ("y", y)):
        leaves = [] if data is None else tree.flatten(data)
        if not leaves or any(np.ndim(leaf) == 0 for leaf in leaves):
            raise ValueError(
                f"Invalid value for argument `{name}`: got {type(data).__name__}. Pass arrays "
                "(or a structure of arrays) with one row per sample."
            )
        sizes.update(int(np.shape(leaf)[0]) for leaf in leaves)
    if len(sizes) != 1:
        raise ValueError(
            f"Invalid data: `x` and `y` have different numbers of rows ({sorted(sizes)}). "
            "Pass the same number of samples in every array."
        )
    samples = sizes.pop()
    if samples < batch_size:
        raise ValueError(
            f"Invalid value for argument `batch_size`: got {batch_size} for {samples} "
            f"samples. Pass a batch size of at most {samples}, or more samples."
        )
    return min(samples // batch_size, _MAX_BATCHES) * batch_size


def _check_positive_int(value: Any, name: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(
            f"Invalid value for argument `{name}`: got {value!r}. Pass a positive integer, {hint}."
        )
    return int(value)


def _check_positive_number(value: Any, name: str, hint: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"Invalid value for argument `{name}`: got {value!r}. Pass a positive number of "
            f"seconds, e.g. {hint}."
        )
    return float(value)


def _check_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(
            f"Invalid value for argument `memory_fraction`: got {value!r}. Pass a number in "
            "(0, 1], e.g. `memory_fraction=0.9`."
        )
    return float(value)


def _check_min_gain(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(
            f"Invalid value for argument `min_gain`: got {value!r}. Pass a number >= 0, e.g. "
            "`min_gain=0.1` to go on while doubling the pack adds at least 10% throughput."
        )
    return float(value)


def _check_compile_kwargs(compile_kwargs: Any) -> dict[str, Any]:
    if compile_kwargs is None:
        return dict(_DEFAULT_COMPILE)
    if not isinstance(compile_kwargs, dict):
        raise TypeError(
            f"Invalid type for argument `compile_kwargs`: got {type(compile_kwargs).__name__}. "
            'Pass a dict of ModelPack.compile arguments, e.g. `{"optimizer": "adam", '
            '"loss": "mse"}`.'
        )
    allowed = set(inspect.signature(ModelPack.compile).parameters) - {"self"}
    unknown = sorted(set(compile_kwargs) - allowed)
    if unknown:
        raise ValueError(
            f"Invalid value for argument `compile_kwargs`: unknown keys {unknown}. Accepted: "
            f"{', '.join(sorted(allowed))}."
        )
    return {**_DEFAULT_COMPILE, **compile_kwargs}
