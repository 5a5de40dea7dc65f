"""A search SIGKILLed at several moments resumes to exactly max_trials trials, each run once."""

import json
import os
import subprocess
import sys

import keras
import pytest
import tuner_helpers as th
from hang_guard import HANG_GUARD_S

import keras_gpushare as kg

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "tuner_search_script.py")
MAX_TRIALS = 6


TENSORFLOW_ONLY = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the same chief code runs on TensorFlow"
)


def _completed_files(project: str) -> dict:
    files = {}
    for trial_id, (status, _) in th.trial_states(project).items():
        if status == "COMPLETED":
            with open(os.path.join(project, f"trial_{trial_id}", "trial.json")) as f:
                files[trial_id] = f.read()
    return files


# `make test` (CI) kills, on TensorFlow, the pack executor's search mid-write, the processes
# executor's chief after a trial ended and the slots executor's search mid-fit: each moment
# and executor once (the resume is the chief's and the ledger's code, the same on every
# backend). `make test-all` adds the other moments, the devices executor (the processes
# executor's chief, a worker per device) and JAX.
pytestmark = pytest.mark.slow if keras.backend.backend() == "jax" else []


@pytest.mark.parametrize(
    "point, executor",
    [
        pytest.param("fit", "pack", marks=pytest.mark.slow),
        pytest.param("ended", "pack", marks=pytest.mark.slow),
        pytest.param("created", "pack", marks=pytest.mark.slow),
        ("mid-write", "pack"),
        # The chief's resume is backend-neutral code: counted once, on TensorFlow (the
        # workers' own trials run on JAX in test_tuner_devices.py and the conformance run).
        pytest.param("ended", "processes", marks=TENSORFLOW_ONLY),
        pytest.param("ended", "devices", marks=[TENSORFLOW_ONLY, pytest.mark.slow]),
        ("fit", "slots"),
        pytest.param("ended", "slots", marks=pytest.mark.slow),
    ],
)
def test_killed_search_resumes_without_losing_or_repeating_trials(tmp_path, point, executor):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path), executor, str(MAX_TRIALS), "2", point],
        env=env,
        timeout=HANG_GUARD_S,
        capture_output=True,
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    project = os.path.join(tmp_path, "search")
    done_before = _completed_files(project)
    assert len(done_before) < MAX_TRIALS

    tuner = kg.tuner.ParallelTuner(
        th.build_mlp,
        objective="val_loss",
        max_trials=MAX_TRIALS,
        parallel_trials=2,
        **({"devices": [0, 1]} if executor == "devices" else {"executor": executor}),
        seed=5,
        directory=str(tmp_path),
        project_name="search",
    )
    x, y = th.data()
    tuner.search(x, y, epochs=3, validation_split=0.25, verbose=0)

    states = th.trial_states(project)
    assert sorted(states) == [str(i) for i in range(MAX_TRIALS)]
    assert all(status == "COMPLETED" for status, _ in states.values())
    oracle = th.oracle_state(project)
    assert sorted(oracle["end_order"]) == sorted(states)  # each trial ended exactly once
    assert all(oracle["run_times"][t] == 1 for t in states)
    assert oracle["ongoing_trials"] == {} and oracle["retry_queue"] == []
    # Trials finished before the kill were not run again: their files are untouched.
    after = _completed_files(project)
    for trial_id, text in done_before.items():
        assert json.loads(after[trial_id]) == json.loads(text)
