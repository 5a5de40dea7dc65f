"""The search of find_pack_size against a deterministic fake measurer: which sizes it tries,
when it stops, what it suggests. No model is trained; the throughputs are given."""

import math

import pytest

from keras_gpushare.autopack import result as res
from keras_gpushare.autopack.search import _Search, _sizes

GRAPH, FUSED = "graph", "fused"


class FakeMeasurer:
    """Returns given throughputs; a single member trains on the graph engine unless forced
    (as on TensorFlow), packs fused. Each measurement advances a fake clock."""

    on_gpu = False
    device = "CPU"
    memory_kind = "host RSS growth"

    def __init__(self, rates, seconds=1.0, oom_from=None, single_engine=GRAPH, mib_each=10.0):
        self.rates = rates  # {(members, engine): model-samples/s}
        self.seconds = seconds
        self.oom_from = oom_from
        self.single_engine = single_engine
        self.mib_each = mib_each
        self.now = 0.0
        self.asked = []
        self.opened = self.closed = 0

    def open(self):
        self.opened += 1

    def close(self):
        self.closed += 1

    def clock(self):
        return self.now

    def measure(self, n, fuse="auto"):
        engine = FUSED if fuse is True or n > 1 else self.single_engine
        self.asked.append((n, engine))
        seconds = self.seconds(n) if callable(self.seconds) else self.seconds
        self.now += seconds
        row = res.PackSizeMeasurement(members=n, engine=engine, seconds=seconds)
        if self.oom_from is not None and n >= self.oom_from:
            row.status, row.error = res.OUT_OF_MEMORY, "ResourceExhaustedError: OOM"
            return row
        row.samples_per_s = float(self.rates[(n, engine)])
        row.spread, row.timed_epochs = 0.05, 5
        row.memory_mib = self.mib_each * n
        row.memory_fraction = self.share(row.memory_mib)
        return row

    def share(self, mib):
        return mib / 1000.0

    def expected_share(self, last, n):
        return self.share(last.memory_mib * n / last.members)


def fused_series(**rates):
    """{(n, "fused"): rate} from keyword arguments such as f8=300."""
    return {(int(k[1:]), FUSED): v for k, v in rates.items()}


def search(fake, max_members=64, min_gain=0.1, patience=2, budget=1e9, memory_fraction=0.9):
    s = _Search(fake, memory_fraction, budget, min_gain, patience, clock=fake.clock)
    return s.run(_sizes(max_members), progress=None)


def test_a_single_graph_member_is_not_compared_with_fused_packs():
    # `make demo` on two cores: one member on the graph engine beat two fused members
    # (XLA compile and all), and the old search stopped there and suggested 1 while the fused
    # pack of 64 ran 11x faster. Every size is now also compared with one fused member.
    rates = {(1, GRAPH): 42_000, (1, FUSED): 30_000}
    rates.update(fused_series(f2=40_000, f4=80_000, f8=160_000, f16=300_000, f32=420_000))
    rates.update(fused_series(f64=470_000))
    fake = FakeMeasurer(rates)
    result = search(fake)
    assert fake.asked == [
        (1, GRAPH),
        (2, FUSED),
        (1, FUSED),
        (4, FUSED),
        (8, FUSED),
        (16, FUSED),
        (32, FUSED),
        (64, FUSED),
    ]
    # The reference row is listed before the pack it serves.
    assert [(r.members, r.engine) for r in result.measurements][:3] == [
        (1, GRAPH),
        (1, FUSED),
        (2, FUSED),
    ]
    assert (result.pack_size, result.engine, result.stopped_by) == (64, FUSED, "max_members")
    assert result.reason.startswith("the best measured: 470,000 model-samples/s on the fused")
    assert "11.2x one member (graph engine)" in result.reason
    lines = result.table().splitlines()
    gains = [line.split()[5] for line in lines[1:]]
    assert gains == ["-", "-", "1.33x", "2.00x", "2.00x", "1.88x", "1.40x", "1.12x"]
    assert lines[-1].endswith("ok  <- suggested")
    assert fake.opened == fake.closed == 1


def test_one_member_fused_by_default_is_measured_once():
    # On JAX a single member already trains fused: no extra reference row.
    rates = fused_series(f1=30_000, f2=60_000, f4=120_000)
    fake = FakeMeasurer(rates, single_engine=FUSED)
    result = search(fake, max_members=4)
    assert fake.asked == [(1, FUSED), (2, FUSED), (4, FUSED)]
    assert result.pack_size == 4


def test_one_noisy_size_does_not_end_the_search():
    rates = {(1, GRAPH): 40_000}
    rates.update(fused_series(f1=40_000, f2=80_000, f4=160_000, f8=300_000, f16=250_000))
    rates.update(fused_series(f32=700_000, f64=720_000, f128=700_000, f256=900_000))
    fake = FakeMeasurer(rates, mib_each=1.0)
    result = search(fake, max_members=256)
    # 16 dipped (another process took the CPU); 32 gained again, so the search went on.
    assert result.stopped_by == "plateau"
    assert [r.members for r in result.measurements if r.engine == FUSED] == [1, 2, 4, 8, 16] + [
        32,
        64,
        128,
    ]
    assert (result.pack_size, result.engine) == (32, FUSED)
    assert "64, 128 members gave 1.03x, 1.00x the model-samples/s of 32" in result.reason


def test_the_suggestion_is_the_best_measured_size_not_the_last():
    rates = {(1, GRAPH): 10_000}
    rates.update(fused_series(f1=10_000, f2=20_000, f4=40_000, f8=80_000, f16=500_000))
    rates.update(fused_series(f32=520_000, f64=480_000))
    result = search(FakeMeasurer(rates))
    assert result.stopped_by == "plateau"
    assert result.pack_size == 16  # 32 brought 4%, less than min_gain: not worth it
    assert result.suggested().samples_per_s == 500_000
    assert sum("<- suggested" in line for line in result.table().splitlines()) == 1


@pytest.mark.parametrize(
    "patience, sizes", [(1, [1, 1, 2]), (2, [1, 1, 2, 4]), (3, [1, 1, 2, 4, 8])]
)
def test_patience_is_the_number_of_sizes_in_a_row_without_gain(patience, sizes):
    rates = {(1, GRAPH): 100_000}
    rates.update(fused_series(f1=50_000, f2=105_000, f4=90_000, f8=100_000, f16=104_000))
    result = search(FakeMeasurer(rates), patience=patience)
    assert [r.members for r in result.measurements] == sizes
    assert (result.pack_size, result.engine) == (1, GRAPH)


def test_min_gain_prefers_the_smaller_pack_when_a_larger_one_brings_little():
    rates = {(1, GRAPH): 100}
    rates.update(fused_series(f1=100, f2=200, f4=400, f8=430, f16=435))
    assert search(FakeMeasurer(rates), max_members=16, min_gain=0.1).pack_size == 4
    assert search(FakeMeasurer(rates), max_members=16, min_gain=0.0).pack_size == 16


def test_out_of_memory_keeps_the_best_measured_size():
    rates = {(1, GRAPH): 100}
    rates.update(fused_series(f1=100, f2=200, f4=400))
    result = search(FakeMeasurer(rates, oom_from=8))
    assert result.stopped_by == "out_of_memory"
    assert result.pack_size == 4
    assert "stopped: out of memory at 8 members (ResourceExhaustedError: OOM)" in result.reason
    assert [r.status for r in result.measurements][-1] == "out_of_memory"


def test_a_size_that_would_overrun_the_time_budget_is_not_started():
    rates = {(1, GRAPH): 100}
    rates.update(fused_series(f1=100, f2=200, f4=400, f8=800))
    # Each size takes n seconds; after 1+2+1+4 = 8 s, 10 s are left and 8 members would
    # take at least the 4 s of 4 members: it runs; 16 would then start at 16 s of 20.
    fake = FakeMeasurer(rates, seconds=lambda n: float(n))
    result = search(fake, budget=20.0)
    assert result.stopped_by == "time_budget"
    assert [r.members for r in result.measurements] == [1, 1, 2, 4, 8]
    assert "16 members would take at least the 8.0 s that 8 took, and 4.0 s are left" in (
        result.reason
    )
    assert result.pack_size == 8


def test_memory_extrapolation_stops_before_a_size_that_would_not_fit():
    rates = {(1, GRAPH): 100}
    rates.update(fused_series(f1=100, f2=200, f4=400, f8=800, f16=1600))
    result = search(FakeMeasurer(rates, mib_each=50.0), memory_fraction=0.5)
    # 8 members hold 400 of 1000 MiB; 16 would hold 800, above half.
    assert result.stopped_by == "memory_fraction"
    assert result.pack_size == 8
    assert "16 members would need about 80% of the host memory" in result.reason


def test_nothing_measured_suggests_one():
    result = search(FakeMeasurer({}, oom_from=1))
    assert result.pack_size == 1 and result.engine == ""
    assert result.suggested() is None
    assert result.reason.endswith("no pack size could be measured, so 1 is suggested")
    assert math.isnan(result.measurements[0].samples_per_s)
