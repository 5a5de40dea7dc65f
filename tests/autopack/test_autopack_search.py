"""find_pack_size on the CPU, training real packs: what it measures, out-of-memory, limits,
argument errors. The search's decisions are tested with a fake in test_autopack_decisions.py."""

import math
import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import keras_gpushare as kg
from keras_gpushare.autopack import measure
from keras_gpushare.pack import ModelPack

sys.path.insert(0, os.path.dirname(__file__))
from autopack_builders import tiny_mlp  # noqa: E402

GPUS = measure.gpu_names()


def _data(rows=1024):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 10)).astype("float32")
    return x, x[:, :1] * 2.0


def _oom(size):
    return tf.errors.ResourceExhaustedError(
        None, None, f"OOM when allocating tensor for a pack of {size}"
    )


def test_finds_a_pack_larger_than_one_and_reports_what_it_measured():
    x, y = _data()
    seen = []
    started = time.perf_counter()
    result = kg.find_pack_size(
        tiny_mlp,
        x,
        y,
        batch_size=32,
        max_members=4,
        time_budget_s=80,
        min_gain=0.0,
        progress=seen.append,
    )
    search_seconds = time.perf_counter() - started
    assert result.measurements == seen
    # Every size up to max_members is measured, each as soon as it is taken. One member
    # trains on the graph engine (fuse="auto" has nothing to fuse it with); the packs fuse,
    # so one member is measured fused as well, to compare on one engine.
    assert [(row.members, row.engine) for row in seen] == [
        (1, "graph"),
        (1, "fused"),
        (2, "fused"),
        (4, "fused"),
    ]
    suggested = result.suggested()
    assert (suggested.members, suggested.engine) == (result.pack_size, result.engine)
    assert suggested.samples_per_s == max(r.samples_per_s for r in seen)  # min_gain=0
    for row in seen:
        assert row.status == "ok"
        assert row.samples_per_s > 0
        assert row.timed_epochs >= 5 and row.spread >= 0
        # `seconds` is the size's whole wall time (what the search budgets the next size
        # by): it holds the timed epochs, at least half of which last the median epoch
        # that gives `samples_per_s`.
        median_epoch_s = row.members * len(x) / row.samples_per_s
        assert row.seconds > math.ceil(row.timed_epochs / 2) * median_epoch_s
        assert math.isclose(row.per_member, row.samples_per_s / row.members)
        assert row.memory_mib >= 0 and 0 < row.memory_fraction < 1
        assert math.isnan(row.gpu_util) != bool(GPUS)  # NVML figures with a GPU only
    # ... and only that size's: the sizes, measured one after another, fit in the search.
    assert sum(row.seconds for row in seen) <= search_seconds
    if GPUS:
        assert result.device.startswith("GPU") and result.memory_kind == "GPU memory peak"
    else:
        assert result.device == "CPU" and result.memory_kind == "host RSS growth"
    assert result.stopped_by in ("max_members", "plateau")
    table = str(result).splitlines()
    assert table[1].split()[:4] == ["members", "engine", "model-samples/s", "spread"]
    for row, line in zip(seen, table[2:]):
        assert line.split()[:3] == [str(row.members), row.engine, f"{row.samples_per_s:,.0f}"]
    assert table[-1].startswith(f"suggested pack size: {result.pack_size} (the best measured: ")


def test_out_of_memory_in_the_builder_stops_at_the_last_good_size():
    def build(i):
        if i >= 2:  # a pack of 4 does not fit
            raise _oom(i + 1)
        return tiny_mlp(i)

    x, y = _data(512)
    result = kg.find_pack_size(build, x, y, batch_size=32, max_members=16, min_gain=0.0)
    # The suggestion is the best measured size below the one that ran out of memory (which of
    # 1 and 2 measured faster depends on the machine's load, not on the rule).
    measured = [r for r in result.measurements if r.status == "ok"]
    best = max(measured, key=lambda r: r.samples_per_s)
    assert result.pack_size == best.members <= 2
    assert result.stopped_by == "out_of_memory"
    assert "out of memory at 4 members" in result.reason
    assert [(r.members, r.engine, r.status) for r in result.measurements] == [
        (1, "graph", "ok"),
        (1, "fused", "ok"),
        (2, "fused", "ok"),
        (4, "", "out_of_memory"),
    ]
    assert "ResourceExhaustedError" in result.measurements[-1].error
    assert "out of memory" in str(result)


def test_out_of_memory_in_the_step_is_caught_and_recovered(monkeypatch):
    train_step = ModelPack.train_step

    def step(self, *args):
        if len(self._members) >= 2:
            raise _oom(len(self._members))
        return train_step(self, *args)

    monkeypatch.setattr(ModelPack, "train_step", step)
    x, y = _data(512)
    result = kg.find_pack_size(tiny_mlp, x, y, batch_size=32, max_members=8, min_gain=0.0)
    assert result.pack_size == 1
    assert result.stopped_by == "out_of_memory"
    assert [r.status for r in result.measurements] == ["ok", "out_of_memory"]
    # The session is usable afterwards.
    monkeypatch.undo()
    pack = ModelPack.from_builder(tiny_mlp, 2)
    pack.compile(optimizer="adam", loss="mse")
    pack.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_other_errors_are_not_swallowed():
    def build(i):
        raise ValueError("a bug in the model")

    x, y = _data(64)
    with pytest.raises(ValueError, match="a bug in the model"):
        kg.find_pack_size(build, x, y, batch_size=32)


def test_time_budget_stops_the_search():
    x, y = _data(2048)
    result = kg.find_pack_size(tiny_mlp, x, y, batch_size=32, time_budget_s=0.3)
    assert result.stopped_by == "time_budget"
    assert result.pack_size == 1
    assert len(result.measurements) == 1
    assert result.measurements[0].status in ("time_budget", "ok")


def test_memory_fraction_stops_the_search():
    x, y = _data(256)
    result = kg.find_pack_size(tiny_mlp, x, y, batch_size=32, memory_fraction=1e-9)
    assert result.stopped_by == "memory_fraction"
    assert result.measurements[0].status == "memory_fraction"
    assert result.pack_size == 1
    assert "no pack size could be measured" in result.reason


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"build_fn": 3}, TypeError, "argument `build_fn`: got int"),
        ({"build_fn": lambda width, seed: None}, TypeError, "takes 2 required arguments"),
        ({"batch_size": 0}, ValueError, "argument `batch_size`: got 0"),
        ({"batch_size": 100}, ValueError, "got 100 for 64 samples"),
        ({"y": np.zeros((63, 1))}, ValueError, r"different numbers of rows \(\[63, 64\]\)"),
        ({"x": None}, ValueError, "argument `x`: got NoneType"),
        ({"max_members": 0}, ValueError, "argument `max_members`: got 0"),
        ({"memory_fraction": 1.5}, ValueError, r"`memory_fraction`: got 1.5. Pass a number in"),
        ({"time_budget_s": -1}, ValueError, "argument `time_budget_s`: got -1"),
        ({"min_gain": -0.5}, ValueError, "argument `min_gain`: got -0.5"),
        ({"patience": 0}, ValueError, "argument `patience`: got 0"),
        ({"compile_kwargs": "adam"}, TypeError, "`compile_kwargs`: got str"),
        ({"compile_kwargs": {"lr": 1}}, ValueError, r"unknown keys \['lr'\]"),
        ({"progress": 1}, TypeError, "argument `progress`: got int"),
    ],
)
def test_argument_errors_are_raised_before_any_work(kwargs, error, match):
    calls = []

    def build(i):
        calls.append(i)
        return tiny_mlp(i)

    x, y = _data(64)
    arguments = {"build_fn": build, "x": x, "y": y, "batch_size": 32, **kwargs}
    with pytest.raises(error, match=match):
        kg.find_pack_size(**arguments)
    assert calls == []
