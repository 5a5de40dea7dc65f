"""The benchmark harness's measurement rules (keras-gpushare bench, benchmarks/): which epochs
count, how repeats interleave and how they are summarized, and how benchmarks/ adds its own
runs. No model is trained here; the `bench --plot` test in tests/autopack runs the harness
end to end."""

import pathlib

import pytest

from keras_gpushare._seeds_benchmark import measure, report, workload
from keras_gpushare._seeds_benchmark.config import BenchConfig

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def test_warm_up_epochs_are_left_out_and_the_median_is_taken():
    times = [9.0, 3.0, 1.0, 1.25, 0.5]  # compile, a first-step stall, then steady epochs
    timed = workload.timed_epochs(times, {"warmup": 2})
    assert timed == [1.0, 1.25, 0.5]
    rates = workload.throughput(100.0, timed)
    assert rates["epoch_rates"] == [100.0, 80.0, 200.0]
    assert rates["steady_rate"] == 100.0  # one fast or slow epoch does not move it
    assert "cpu_rate" not in rates
    assert workload.throughput(100.0, timed, [0.5, 2.0, 1.0])["cpu_rate"] == 100.0
    assert workload.timed_epochs([2.0], {"warmup": 2}) == [2.0]  # too short: the last epoch


def test_repeats_interleave_and_rotate():
    order = measure.interleaved(3, 3)
    assert order == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1)]
    assert sorted(k for _, k in order) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert measure.interleaved(0, 2) == []


def test_summary_is_the_median_over_repeats_with_its_range():
    repeats = [
        {"steady_rate": 300.0, "wall_s": 5.0, "peak_rss_mib": 10.0},
        {"steady_rate": 100.0, "wall_s": 9.0, "peak_rss_mib": 12.0},
        {"error": "RuntimeError: boom"},
        {"steady_rate": 200.0, "wall_s": 6.0, "peak_rss_mib": 11.0, "note": "4 run"},
    ]
    summary = measure.summarize(repeats)
    assert summary["steady_rate"] == 200.0
    assert (summary["rate_min"], summary["rate_max"]) == (100.0, 300.0)
    assert summary["wall_s"] == 6.0 and summary["peak_rss_mib"] == 12.0
    assert summary["note"] == "4 run; 1 of 4 repeats failed"
    assert measure.summarize([{"error": "E: x"}])["error"] == "E: x"


def test_report_gives_medians_ranges_and_ratios():
    config = BenchConfig(members=(4,), repeats=2)
    seq = measure.summarize(
        [
            {"steady_rate": 100.0, "wall_s": 10.0, "peak_rss_mib": 1.0, "load": 2.0},
            {"steady_rate": 120.0, "wall_s": 12.0, "peak_rss_mib": 1.0, "load": 3.5},
        ]
    )
    fused = measure.summarize(
        [
            {"steady_rate": 1000.0, "wall_s": 2.0, "peak_rss_mib": 2.0, "load": 2.5},
            {"steady_rate": 1200.0, "wall_s": 3.0, "peak_rss_mib": 2.0, "load": 3.0},
        ]
    )
    text = report.format_report(config, [("sequential", 4, seq), ("pack-fused", 4, fused)])
    assert "load average (1 min) when the runs started: 2.0-3.5" in text
    assert "median [min-max] over 2 interleaved repeat(s)" in text
    assert "steady: median of epochs 3-5 of a run" in text
    row = next(line for line in text.splitlines() if "pack-fused" in line).split()
    assert row[:4] == ["4", "pack-fused", "2.5", "4.40"]  # 11 s / 2.5 s
    assert row[4:8] == ["1,100", "[1,000-1,200]", "10.00", "-"]  # no CPU times given


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epochs": 2}, "Pass at least 3 so that an epoch is timed"),
        ({"epochs": 1, "warmup": 1}, "Pass at least 2"),
    ],
)
def test_too_few_epochs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kwargs)


def test_overrides_check_threads_and_repeats():
    config = BenchConfig().with_overrides(repeats=5, threads=1)
    assert (config.repeats, config.threads) == (5, 1)
    with pytest.raises(ValueError, match="--repeats: got 0"):
        BenchConfig().with_overrides(repeats=0)
    with pytest.raises(ValueError, match="--threads: got -1"):
        BenchConfig().with_overrides(threads=-1)
    with pytest.raises(ValueError, match="--members: got 'one'"):
        BenchConfig().with_overrides(members="one")
    with pytest.raises(ValueError, match="unknown \\['torch-vmap'\\]"):
        BenchConfig().with_overrides(methods="pack-fused,torch-vmap")
    with pytest.raises(ValueError, match="--epochs: got 2 with 2 warm-up"):
        BenchConfig().with_overrides(epochs=2)


def test_runs_cover_every_method_and_member_count():
    config = BenchConfig(members=(1, 4), threads=2)
    runs = measure.plan_runs(config)
    labels = [(label, n) for label, n, _, _ in runs]
    assert labels == [
        ("sequential", 1),
        ("pool(1)", 1),
        ("pack-graph", 1),
        ("pack-fused", 1),
        ("sequential", 4),
        ("pool(2)", 4),
        ("pool(4)", 4),
        ("pack-graph", 4),
        ("pack-fused", 4),
    ]
    fused = runs[-1][3]
    assert fused["fuse"] and fused["threads"] == 2 and fused["widths"] == [64] * 4
    assert (fused["warmup"], fused["epochs"]) == (2, 5)


def test_the_torch_peer_runs_with_its_own_thread_count(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    torch_ensemble = pytest.importorskip("_torch_ensemble")
    monkeypatch.setattr(torch_ensemble.importlib.util, "find_spec", lambda name: object())
    config = BenchConfig(members=(2,), threads=2)
    runs = torch_ensemble.torch_runs(config, threads=(1,))
    assert [(label, n, run["threads"]) for label, n, _, run in runs] == [("torch-vmap", 2, 1)]
    both = torch_ensemble.torch_runs(config, threads=(1, 0))
    assert [(label, run["threads"]) for label, _, _, run in both] == [
        ("torch-vmap(1t)", 1),
        ("torch-vmap(auto)", 0),
    ]
    mixed = BenchConfig(members=(2,), architecture="mixed")
    assert torch_ensemble.torch_runs(mixed, threads=(1,)) == []


def test_sampled_sequential_runs_scale_their_time(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sampled = pytest.importorskip("_sampled_sequential")
    runs = measure.plan_runs(BenchConfig(members=(2, 8), methods=("sequential", "pack-fused")))
    limited = sampled.sample_sequential(runs, at_most=4)
    assert [runner for _, _, runner, _ in limited] == [
        workload.run_sequential,
        workload.run_pack,
        sampled.run_sampled,
        workload.run_pack,
    ]
    ran = []

    def fake_sequential(config):
        ran.append(len(config["widths"]))
        return {"wall_s": 2.0, "steady_rate": 10.0}

    monkeypatch.setattr(sampled, "run_sequential", fake_sequential)
    result = sampled.run_sampled(limited[2][3])
    assert ran == [4]
    assert result == {"wall_s": 4.0, "steady_rate": 10.0, "note": "4 run, time scaled"}
