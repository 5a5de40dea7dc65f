"""Runs the same search with a KerasTuner tuner and with ParallelTuner, and compares them.

`KIND`s: "kt" is KerasTuner's own tuner; an integer K is `ParallelTuner(parallel_trials=K,
executor="pack")`; `SLOTS` is `ParallelTuner(parallel_trials=4, executor="slots")`;
`PROCESSES` is `ParallelTuner(parallel_trials=2, executor="processes")`
(two worker processes, each importing TensorFlow: a few seconds a search). What a user sees
is put side by side: trials (ids, hyperparameters, statuses, scores, best steps, recorded
metrics, last line of the message), printed output (numbers and durations masked), files
in the project folder.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
from collections.abc import Callable
from typing import Any

import keras
import keras_tuner
import numpy as np
import pytest

import keras_gpushare as kg

SLOTS = "slots"
PROCESSES = "processes"
PROCESS_WORKERS = 2
BACKEND = keras.backend.backend()
# The executor `executor="auto"` picks: "slots" on JAX, "pack" (K=4) on TensorFlow and torch.
DEFAULT = SLOTS if BACKEND == "jax" else 4
SLOW_ON_JAX = pytest.mark.slow if BACKEND == "jax" else []


def _slow(kind: Any) -> Any:
    return pytest.param(kind, marks=pytest.mark.slow)


# parallel_trials=1 runs only with the slow tests (`make test-all`): K=4 is what packs do,
# K=1 the degenerate round of one trial. EVERY_EXECUTOR compares both executors of a round
# in `make test` (the random search, each trial's data order); PARALLEL compares the
# backend's default executor there and the other one with the slow tests.
EVERY_EXECUTOR = [_slow(1), 4, SLOTS]
PARALLEL = [_slow(1), *(k if k == DEFAULT else _slow(k) for k in (4, SLOTS))]
# The processes executor where a case's scenario is the same: in the default run for the
# random search on TensorFlow (on JAX, test_tuner_devices.py's workers), `slow` for the rest
# (each search starts 2 workers).
_ON_TENSORFLOW = PROCESSES if BACKEND == "tensorflow" else _slow(PROCESSES)
EVERY_WITH_PROCESSES = [*EVERY_EXECUTOR, _ON_TENSORFLOW]
WITH_PROCESSES = PARALLEL + [_slow(PROCESSES)]


def slow_off_tensorflow(test: Callable) -> Callable:
    """`test`, marked `slow` except on TensorFlow, where `make test` runs it."""
    return test if BACKEND == "tensorflow" else pytest.mark.slow(test)


def slow_on_tensorflow(test: Callable) -> Callable:
    """`test`, marked `slow` on TensorFlow only: `make test` runs it on the other backends."""
    return pytest.mark.slow(test) if BACKEND == "tensorflow" else test


def in_workers(reason: str) -> Any:
    """The processes executor, expected to differ from KerasTuner for an inherent `reason`."""
    return pytest.param(
        PROCESSES, marks=[pytest.mark.slow, pytest.mark.xfail(strict=True, reason=reason)]
    )


class ByKind(dict):
    """`{kind: run(kind)}`, each kind's search run when a test first asks for it."""

    def __init__(self, run: Callable[[Any], Any]) -> None:
        super().__init__()
        self._run = run

    def __missing__(self, kind: Any) -> Any:
        self[kind] = value = self._run(kind)
        return value


def data(n: int = 64, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x[:, :2].sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def build(hp) -> keras.Model:
    """A tiny MLP whose initial weights depend only on its hyperparameters."""
    units = hp.Choice("units", [2, 4, 8])
    lr = hp.Float("lr", 1e-3, 1e-1, sampling="log")
    keras.utils.set_random_seed(units)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(keras.optimizers.SGD(lr), "binary_crossentropy", metrics=["accuracy"])
    return model


def build_declaring(hp) -> keras.Model:
    """`build`, with a second layer whose width is declared only when it is built."""
    lr = hp.Float("lr", 1e-3, 1e-1, sampling="log")
    keras.utils.set_random_seed(1)
    layers = [keras.Input((6,))]
    for i in range(hp.Int("layers", 1, 2)):
        layers.append(keras.layers.Dense(hp.Choice(f"units_{i}", [2, 4, 8]), activation="relu"))
    model = keras.Sequential([*layers, keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.SGD(lr), "binary_crossentropy", metrics=["accuracy"])
    return model


class CountingBuild:
    """`build`, but each call seeds from a call counter: executions start differently.

    Both tuners build in the same order (trial by trial, executions inside), so the n-th
    model built has the same initial weights in both.
    """

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, hp) -> keras.Model:
        model = build(hp)
        self.calls += 1
        keras.utils.set_random_seed(1000 + self.calls)
        model.set_weights([np.random.normal(size=w.shape) * 0.5 for w in model.get_weights()])
        return model


def make(kind, oracle=None, hypermodel=build, base_kt=None, mixin=None, fuse="auto", **kwargs):
    """A tuner of `kind`: KerasTuner's (`base_kt`, RandomSearch by default) or ParallelTuner.

    `oracle` is a function making a fresh oracle (for ParallelTuner) whose KerasTuner twin
    is `base_kt` made with the oracle's own arguments in `kwargs`. `mixin` is a class put
    before the tuner class (a user's `run_trial` override, say); `fuse` is ParallelTuner's.
    """
    if kind == "kt":
        base = base_kt or keras_tuner.RandomSearch
        cls = type("UserTuner", (mixin, base), {}) if mixin else base
        return cls(hypermodel=hypermodel, **kwargs)
    cls = _user_tuner(mixin) if mixin else kg.tuner.ParallelTuner
    if oracle is not None:
        oracle_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in ORACLE_KEYS}
        kwargs["oracle"] = oracle(**oracle_kwargs)
    if kind == PROCESSES:
        kwargs["executor"] = "processes"
        kind = PROCESS_WORKERS
    elif kind == SLOTS:
        kwargs["executor"] = "slots"
        kind = 4
    else:
        kwargs.setdefault("executor", "pack")
    return cls(hypermodel=hypermodel, parallel_trials=kind, fuse=fuse, **kwargs)


_USER_TUNERS: dict = {}


def _user_tuner(mixin: type) -> type:
    """`class UserTuner(mixin, ParallelTuner)`, importable as `kt_twins.<its name>`.

    The processes executor's workers rebuild the tuner from its class, pickled by
    reference: they find it here through the module's `__getattr__`.
    """
    name = f"UserTuner__{mixin.__module__}__{mixin.__qualname__}"
    if name not in _USER_TUNERS:
        cls = type(name, (mixin, kg.tuner.ParallelTuner), {"__module__": __name__})
        _USER_TUNERS[name] = cls
    return _USER_TUNERS[name]


def __getattr__(name: str) -> Any:
    if not name.startswith("UserTuner__"):
        raise AttributeError(name)
    _, module, qualname = name.split("__", 2)
    return _user_tuner(getattr(importlib.import_module(module), qualname))


ORACLE_KEYS = {
    "objective",
    "max_trials",
    "seed",
    "max_epochs",
    "factor",
    "hyperband_iterations",
    "hyperparameters",
    "max_retries_per_trial",
    "max_consecutive_failed_trials",
    "num_initial_points",
}


def search(tuner, *args, **kwargs) -> str:
    """Runs `tuner.search` and returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tuner.search(*args, **kwargs)
    return out.getvalue()


def printed(fn, *args, **kwargs) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args, **kwargs)
    return out.getvalue()


def trials_view(tuner) -> dict:
    """Each trial as a user reads it from the oracle."""
    view = {}
    for trial_id, trial in tuner.oracle.trials.items():
        metrics = {
            name: [(obs.step, obs.value) for obs in history.get_history()]
            for name, history in trial.metrics.metrics.items()
        }
        message = (trial.message or "").strip().splitlines()
        view[trial_id] = {
            "values": dict(trial.hyperparameters.values),
            "status": trial.status,
            "score": trial.score,
            "best_step": trial.best_step,
            "metrics": metrics,
            "error": message[-1] if message else None,
        }
    return view


def assert_same_trials(reference, other, rtol=1e-4, atol=1e-5) -> None:
    ref, got = trials_view(reference), trials_view(other)
    assert sorted(got) == sorted(ref)
    for trial_id, expected in ref.items():
        actual = got[trial_id]
        for key in ("values", "status", "best_step", "error"):
            assert actual[key] == expected[key], (trial_id, key, actual[key], expected[key])
        if expected["score"] is None:
            assert actual["score"] is None, trial_id
        else:
            np.testing.assert_allclose(actual["score"], expected["score"], rtol=rtol, atol=atol)
        assert sorted(actual["metrics"]) == sorted(expected["metrics"]), trial_id
        for name, observations in expected["metrics"].items():
            steps = [step for step, _ in observations]
            assert [step for step, _ in actual["metrics"][name]] == steps, (trial_id, name)
            np.testing.assert_allclose(
                [v for _, values in actual["metrics"][name] for v in values],
                [v for _, values in observations for v in values],
                rtol=rtol,
                atol=atol,
                err_msg=f"trial {trial_id} metric {name}",
            )


def masked(text: str) -> list[str]:
    """Printed lines with numbers, durations and paths masked, in their order."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"\d\dh \d\dm \d\ds", "<time>", line)
        line = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "<n>", line)
        line = re.sub(r"(Results in|Reloading Tuner from) \S+", r"\1 <path>", line)
        lines.append(line)
    return lines


def project_files(tuner) -> set:
    root = tuner.project_dir
    files = set()
    for folder, _, names in os.walk(root):
        for name in names:
            files.add(os.path.relpath(os.path.join(folder, name), root))
    return files
