"""`find_pack_size`: how many models to train at once on this machine.

The search asks a measurer (measure.py) for packs of 1, 2, 4, ... members and decides from
the rows it gets back: which size to try next, when to stop, which size to suggest. It trains
no model itself and reads time from an injected clock, so it is tested with a deterministic
fake measurer and a fake clock.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import time
from collections.abc import Callable
from typing import Any, Protocol

import keras
import numpy as np
from keras import tree

from keras_gpushare.autopack.measure import PackMeasurer
from keras_gpushare.autopack.result import (
    MAX_MEMBERS,
    MEMORY_FRACTION,
    OK,
    OUT_OF_MEMORY,
    PLATEAU,
    TIME_BUDGET,
    PackSizeMeasurement,
    PackSizeResult,
)
from keras_gpushare.pack import ModelPack

logger = logging.getLogger(__name__)

_MAX_BATCHES = 64  # batches per epoch: enough for steady state, short enough for many sizes
_DEFAULT_COMPILE = {"optimizer": "adam", "loss": "mse"}


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
    patience: int = 2,
    progress: Callable[[PackSizeMeasurement], None] | None = None,
) -> PackSizeResult:
    """Finds how many models to pack together for the best throughput on this machine.

    Trains short packs of 1, 2, 4, 8, ... members (`ModelPack.from_builder(build_fn, n)`,
    fused where the members allow it) on up to 64 batches of `x`, `y`: two warm-up epochs
    (tracing, XLA compilation), then at least five timed epochs and half a second. For each
    size it records the steady-state aggregate throughput (model-samples per second, from the
    median timed epoch, with the spread of the timed epochs), the peak memory (the framework
    allocator's peak with a GPU, this process's resident memory growth without) and, with a
    GPU, NVML utilization during the timed epochs. When one member trains on another engine
    than the packs (TensorFlow trains a single member on the graph engine), one member is
    also measured on the packs' engine, so every size is compared on its own engine too.

    The suggestion is the measured size with the best throughput, where a larger size must
    bring `min_gain` more than the best so far to count as better. The search stops when
    `patience` sizes in a row brought no such gain (so one noisy size does not end it), when
    a size runs out of memory (the error is caught and the session cleared), when the peak
    memory passes `memory_fraction` of the device (or the next size would), when the time
    budget is spent, or at `max_members`.

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
        min_gain: the relative throughput gain a larger pack must bring over the best size
            so far to be suggested instead (`0.1`: 10% more model-samples per second).
            Defaults to `0.1`.
        patience: how many sizes in a row may bring less than `min_gain` before the search
            stops. Defaults to `2`.
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
    patience = _check_positive_int(patience, "patience", "e.g. `patience=2`")
    compile_args = _check_compile_kwargs(compile_kwargs)
    if progress is not None and not callable(progress):
        raise TypeError(
            f"Invalid type for argument `progress`: got {type(progress).__name__}. Pass a "
            "function taking a PackSizeMeasurement, or None."
        )
    x_fit = tree.map_structure(lambda a: a[:rows], x)
    y_fit = tree.map_structure(lambda a: a[:rows], y)
    deadline = time.monotonic() + time_budget_s
    measurer = PackMeasurer(
        build_fn, x_fit, y_fit, batch_size, compile_args, memory_fraction, deadline
    )
    search = _Search(measurer, memory_fraction, deadline, min_gain, patience)
    return search.run(_sizes(max_members), progress)


class _Measurer(Protocol):
    """What the search needs from a measurer (`PackMeasurer`, or a test's fake)."""

    @property
    def on_gpu(self) -> bool: ...

    @property
    def device(self) -> str: ...

    @property
    def memory_kind(self) -> str: ...

    def open(self) -> None: ...

    def close(self) -> None: ...

    def measure(self, n: int, fuse: str | bool = "auto") -> PackSizeMeasurement: ...

    def expected_share(self, last: PackSizeMeasurement, n: int) -> float: ...


class _Search:
    """The doubling search: which size next, when to stop, which size to suggest.

    Args:
        measurer: takes the measurements.
        memory_fraction: the memory share no size may pass.
        deadline: the end of the time budget, on `clock`.
        min_gain: the gain a larger size must bring over the best to replace it.
        patience: sizes in a row without that gain before stopping.
        clock: the clock of `deadline`. Defaults to `time.monotonic`.
    """

    def __init__(
        self,
        measurer: _Measurer,
        memory_fraction: float,
        deadline: float,
        min_gain: float,
        patience: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.measurer = measurer
        self.memory_fraction = memory_fraction
        self.deadline = deadline
        self.min_gain = min_gain
        self.patience = patience
        self.clock = clock
        self.rows: list[PackSizeMeasurement] = []
        self.best: PackSizeMeasurement | None = None
        self.last: PackSizeMeasurement | None = None  # the last size of the doubling
        self.stalled: list[PackSizeMeasurement] = []  # sizes in a row that did not gain

    def run(
        self, sizes: list[int], progress: Callable[[PackSizeMeasurement], None] | None
    ) -> PackSizeResult:
        stopped_by, reason = MAX_MEMBERS, f"reached max_members={sizes[-1]}"
        self.measurer.open()
        try:
            for n in sizes:
                early = self._stop_before(n)
                if early is not None:
                    stopped_by, reason = early
                    break
                row = self.measurer.measure(n)
                reference = self._reference_for(row)
                if reference is not None:
                    self._record(reference, progress)
                self._record(row, progress)
                if row.status != OK:
                    stopped_by, reason = row.status, _failure_reason(row, self.memory_fraction)
                    break
                self.last = row
                if len(self.stalled) >= self.patience:
                    stopped_by, reason = PLATEAU, self._plateau_reason()
                    break
                if self.clock() > self.deadline:
                    stopped_by, reason = TIME_BUDGET, "the time budget is spent"
                    break
        finally:
            self.measurer.close()
        best = self.best
        if best is None:
            reason += "; no pack size could be measured, so 1 is suggested"
        else:
            reason = f"{self._why(best)}; stopped: {reason}"
        return PackSizeResult(
            pack_size=best.members if best is not None else 1,
            engine=best.engine if best is not None else "",
            reason=reason,
            stopped_by=stopped_by,
            measurements=self.rows,
            device=self.measurer.device,
            memory_kind=self.measurer.memory_kind,
        )

    def _reference_for(self, row: PackSizeMeasurement) -> PackSizeMeasurement | None:
        """One member on `row`'s engine when none was measured yet (a single member trains
        on the graph engine by default on TensorFlow, packs of the same models fused)."""
        if row.status != OK or row.members == 1 or row.engine != "fused":
            return None
        if any(r.members == 1 and r.engine == row.engine for r in self.rows):
            return None
        reference = self.measurer.measure(1, fuse=True)
        return reference if reference.status == OK else None

    def _record(
        self, row: PackSizeMeasurement, progress: Callable[[PackSizeMeasurement], None] | None
    ) -> None:
        self.rows.append(row)
        logger.info("find_pack_size: %s", row)
        if progress is not None:
            progress(row)
        if row.status != OK:
            return
        best = self.best
        if best is None or (
            row.samples_per_s > best.samples_per_s
            if row.members <= best.members
            else row.samples_per_s >= (1 + self.min_gain) * best.samples_per_s
        ):
            self.best = row
            self.stalled = []
        elif row.members > best.members:
            self.stalled.append(row)

    def _why(self, best: PackSizeMeasurement) -> str:
        text = (
            f"the best measured: {best.samples_per_s:,.0f} model-samples/s on the "
            f"{best.engine} engine"
        )
        one = [r for r in self.rows if r.status == OK and r.members == 1]
        if best.members > 1 and one:
            base = max(one, key=lambda r: r.samples_per_s)
            text += (
                f", {best.samples_per_s / base.samples_per_s:.1f}x one member "
                f"({base.engine} engine)"
            )
        return text

    def _plateau_reason(self) -> str:
        best = self.best
        assert best is not None, "a stalled size was measured against the best one"
        gains = ", ".join(f"{r.samples_per_s / best.samples_per_s:.2f}x" for r in self.stalled)
        sizes = ", ".join(str(r.members) for r in self.stalled)
        return (
            f"throughput stopped growing: {sizes} members gave {gains} the model-samples/s "
            f"of {best.members}, below the {1 + self.min_gain:.2f}x asked for"
        )

    def _stop_before(self, n: int) -> tuple[str, str] | None:
        """Why size `n` should not be tried (time or memory it would need), or None."""
        last = self.last
        if last is None:
            return None
        left = self.deadline - self.clock()
        if left < last.seconds:
            return (
                TIME_BUDGET,
                f"time budget: {n} members would take at least the {last.seconds:.1f} s "
                f"that {last.members} took, and {max(left, 0.0):.1f} s are left",
            )
        share = self.measurer.expected_share(last, n)
        if share > self.memory_fraction:
            return (
                MEMORY_FRACTION,
                f"memory: {n} members would need about {100 * share:.0f}% of the "
                f"{'GPU' if self.measurer.on_gpu else 'host'} memory, above memory_fraction="
                f"{self.memory_fraction}",
            )
        return None


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
    sizes: set[int] = set()
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
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) <= 1:
        raise ValueError(
            f"Invalid value for argument `memory_fraction`: got {value!r}. Pass a number in "
            "(0, 1], e.g. `memory_fraction=0.9`."
        )
    return float(value)


def _check_min_gain(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) >= 0:
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
