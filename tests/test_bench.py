"""The benchmark harness's measurement rules (keras-gpushare bench, benchmarks/): which epochs
count, how repeats interleave and how they are summarized. No model is trained here; the
`bench --plot` test in tests/autopack runs the harness end to end."""

import dataclasses

import pytest

from keras_gpushare._bench import pack, workload


def test_warm_up_epochs_are_left_out_and_the_median_is_taken():
    times = [9.0, 3.0, 1.0, 1.25, 0.5]  # compile, a first-step stall, then steady epochs
    timed = workload._timed(times, {"warmup": 2})
    assert timed == [1.0, 1.25, 0.5]
    rates = workload._rates(100.0, timed)
    assert rates["epoch_rates"] == [100.0, 80.0, 200.0]
    assert rates["steady_rate"] == 100.0  # one fast or slow epoch does not move it
    assert "cpu_rate" not in rates
    assert workload._rates(100.0, timed, [0.5, 2.0, 1.0])["cpu_rate"] == 100.0
    assert workload._timed([2.0], {"warmup": 2}) == [2.0]  # too short: the last epoch


def test_repeats_interleave_and_rotate():
    order = pack.interleaved(3, 3)
    assert order == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1)]
    assert sorted(k for _, k in order) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert pack.interleaved(0, 2) == []


def test_summary_is_the_median_over_repeats_with_its_range():
    repeats = [
        {"steady_rate": 300.0, "wall_s": 5.0, "peak_rss_mib": 10.0},
        {"steady_rate": 100.0, "wall_s": 9.0, "peak_rss_mib": 12.0},
        {"error": "RuntimeError: boom"},
        {"steady_rate": 200.0, "wall_s": 6.0, "peak_rss_mib": 11.0, "note": "4 run"},
    ]
    summary = pack.summarize(repeats)
    assert summary["steady_rate"] == 200.0
    assert (summary["rate_min"], summary["rate_max"]) == (100.0, 300.0)
    assert summary["wall_s"] == 6.0 and summary["peak_rss_mib"] == 12.0
    assert summary["note"] == "4 run; 1 of 4 repeats failed"
    assert pack.summarize([{"error": "E: x"}])["error"] == "E: x"


def test_report_gives_medians_ranges_and_ratios():
    config = pack.BenchConfig(members=(4,), repeats=2)
    seq = pack.summarize(
        [
            {"steady_rate": 100.0, "wall_s": 10.0, "peak_rss_mib": 1.0, "load": 2.0},
            {"steady_rate": 120.0, "wall_s": 12.0, "peak_rss_mib": 1.0, "load": 3.5},
        ]
    )
    fused = pack.summarize(
        [
            {"steady_rate": 1000.0, "wall_s": 2.0, "peak_rss_mib": 2.0, "load": 2.5},
            {"steady_rate": 1200.0, "wall_s": 3.0, "peak_rss_mib": 2.0, "load": 3.0},
        ]
    )
    text = pack.format_report(config, [("sequential", 4, seq), ("pack-fused", 4, fused)])
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
        pack.BenchConfig(**kwargs)


def test_overrides_check_threads_and_repeats():
    config = pack.BenchConfig().with_overrides(repeats=5, threads=1, torch_threads="1,0")
    assert (config.repeats, config.threads, config.torch_threads) == (5, 1, (1, 0))
    with pytest.raises(ValueError, match="--repeats: got 0"):
        pack.BenchConfig().with_overrides(repeats=0)
    with pytest.raises(ValueError, match="--threads: got -1"):
        pack.BenchConfig().with_overrides(threads=-1)
    with pytest.raises(ValueError, match="--torch-threads: got 'one'"):
        pack.BenchConfig().with_overrides(torch_threads="one")
    with pytest.raises(ValueError, match="--epochs: got 2 with 2 warm-up"):
        pack.BenchConfig().with_overrides(epochs=2)


def test_the_torch_peer_runs_with_its_own_thread_count(monkeypatch):
    monkeypatch.setattr(pack.importlib.util, "find_spec", lambda name: object())
    config = pack.BenchConfig(members=(2,), methods=("pack-fused", "torch-vmap"), threads=2)
    runs = {method: run for method, _, run in pack._runs(config)}
    assert runs["pack-fused"]["threads"] == 2
    assert runs["torch-vmap"]["threads"] == 1
    assert runs["pack-fused"]["warmup"] == 2 and runs["pack-fused"]["epochs"] == 5
    both = dataclasses.replace(config, torch_threads=(1, 0))
    labels = {method: run["threads"] for method, _, run in pack._runs(both)}
    assert labels == {"pack-fused": 2, "torch-vmap(1t)": 1, "torch-vmap(auto)": 0}
