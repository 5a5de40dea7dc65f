"""What `find_pack_size` reports: one row per pack size tried, and the size it suggests."""

from __future__ import annotations

import dataclasses
import math

NAN = float("nan")
OK = "ok"
OUT_OF_MEMORY = "out_of_memory"
MEMORY_FRACTION = "memory_fraction"
TIME_BUDGET = "time_budget"
PLATEAU = "plateau"
MAX_MEMBERS = "max_members"


@dataclasses.dataclass
class PackSizeMeasurement:
    """One row of `find_pack_size`'s table: a pack of `members` models, trained briefly.

    Attributes:
        members: number of models in the pack.
        status: `"ok"`, `"out_of_memory"`, `"memory_fraction"` (ran, but above the limit)
            or `"time_budget"` (stopped before enough timed epochs).
        engine: the engine that trained the pack, `pack.engine` after `fit` (empty when the
            pack could not be built).
        samples_per_s: steady-state aggregate throughput, model-samples per second (each
            member's samples counted), from the median timed epoch; NaN when not measured.
        spread: `(fastest - slowest) / median` of the timed epochs' throughputs: how much the
            epochs of this size disagreed (0.1 is 10%); NaN when not measured.
        timed_epochs: how many epochs after the warm-up were timed.
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
    spread: float = NAN
    timed_epochs: int = 0
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
        pack_size: the suggested number of members: the measured size with the best
            throughput (a larger size counts as better only when it brings `min_gain` more).
        engine: the engine that trained the suggested size (`"fused"`, `"graph"`, ...).
        reason: why the search stopped and why this size, in words.
        stopped_by: `"plateau"`, `"out_of_memory"`, `"memory_fraction"`, `"time_budget"`
            or `"max_members"`.
        measurements: one `PackSizeMeasurement` per pack trained, in order. When one member
            trains on another engine than the packs (TensorFlow trains a single member on
            the graph engine, larger packs fused), one member is measured on both, so that
            every size is compared with one member on its own engine.
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
    engine: str = ""

    def table(self) -> str:
        """The measurements as a text table; `gain` is against the previous size measured
        on the same engine, and the suggested row is marked."""
        lines = [
            f"{'members':>7}  {'engine':<6} {'model-samples/s':>15} {'spread':>6} "
            f"{'per member':>11} {'gain':>6} {'memory MiB':>10} {'memory %':>8} "
            f"{'GPU util %':>10} {'seconds':>7}  status"
        ]
        previous: dict[str, PackSizeMeasurement] = {}
        suggested = self.suggested()
        for row in self.measurements:
            gain = "-"
            before = previous.get(row.engine)
            if before is not None and row.status == OK:
                gain = f"{row.samples_per_s / before.samples_per_s:.2f}x"
            status = row.status.replace("_", " ")
            if row is suggested:
                status += "  <- suggested"
            lines.append(
                f"{row.members:>7}  {row.engine or '-':<6} {_fmt(row.samples_per_s, ',.0f'):>15} "
                f"{_fmt(100 * row.spread, '.0f', '%'):>6} {_fmt(row.per_member, ',.0f'):>11} "
                f"{gain:>6} {_fmt(row.memory_mib, ',.1f'):>10} "
                f"{_fmt(100 * row.memory_fraction, '.1f'):>8} {_fmt(row.gpu_util, '.0f'):>10} "
                f"{_fmt(row.seconds, '.1f'):>7}  {status}"
            )
            if row.status == OK:
                previous[row.engine] = row
        return "\n".join(lines)

    def suggested(self) -> PackSizeMeasurement | None:
        """The measurement the suggestion comes from (None when nothing was measured)."""
        for row in self.measurements:
            if row.status == OK and row.members == self.pack_size and row.engine == self.engine:
                return row
        return None

    def __str__(self) -> str:
        return (
            f"find_pack_size on {self.device} (memory: {self.memory_kind})\n"
            f"{self.table()}\n"
            f"suggested pack size: {self.pack_size} ({self.reason})"
        )


def _fmt(value: float, spec: str, unit: str = "") -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec) + unit
