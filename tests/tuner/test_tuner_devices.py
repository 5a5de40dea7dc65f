"""A search over every device of a machine: `ParallelTuner(devices=...)`.

One worker process per device, each pinned to it through `CUDA_VISIBLE_DEVICES` and
streaming its trials through its own executor, coordinated by KerasTuner's chief/worker
protocol. Tested on CPUs (a machine without GPUs runs one worker per entry on the CPU):
trials split between the workers, each equal to plain KerasTuner's on its hyperparameters,
each worker seeing only its own device, and a worker killed mid-trial restarted with its
trial run again. The GPUs the chief checks the entries against are NVML's, stood in for by
the monitor tests' fake `pynvml` (two H100s, or none).
"""

import logging
import os
import sys
import warnings

import keras_tuner
import numpy as np
import pytest
import tuner_helpers as th

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "conformance"))
sys.path.insert(0, os.path.join(HERE, "..", "monitor"))

from fake_nvml import NVML_ERROR_DRIVER_NOT_LOADED, FakeNvml, h100s  # noqa: E402
from kt_twins import assert_same_trials, slow_off_tensorflow, slow_on_tensorflow  # noqa: E402

import keras_gpushare as kg  # noqa: E402

FIT = dict(epochs=2, validation_split=0.25, shuffle=False, verbose=0)


def _search(tmp_path, name, callbacks=(), **kwargs):
    args = dict(
        hypermodel=th.build_noting_device,
        objective="val_loss",
        max_trials=6,
        seed=5,
        directory=str(tmp_path),
        project_name=name,
    )
    if name == "kt":
        tuner = keras_tuner.RandomSearch(**args)
    else:
        # "gpu0" is GPU 0's worker's own name: the entry names the same GPU as `0`.
        tuner = kg.tuner.ParallelTuner(parallel_trials=2, devices=["gpu0", 1], **args, **kwargs)
    tuner.search(*th.data(), callbacks=list(callbacks), **FIT)
    return tuner


@pytest.fixture
def nvml(monkeypatch):
    """`nvml(gpus, **options)` puts a fake `pynvml` listing `gpus` in `sys.modules`."""

    def install(gpus, **options):
        fake = FakeNvml(gpus, **options)
        monkeypatch.setitem(sys.modules, "pynvml", fake.module)
        return fake

    return install


@pytest.fixture
def seen_dir(tmp_path, monkeypatch, nvml):
    nvml(h100s(2))  # the chief checks `devices` against two GPUs, on any machine
    folder = tmp_path / "seen"
    folder.mkdir()
    monkeypatch.setenv(th.SEEN_ENV, str(folder))
    return str(folder)


def test_one_worker_per_device_trains_trials_as_keras_tuner(tmp_path, seen_dir, capsys):
    reference = _search(tmp_path, "kt")
    for name in os.listdir(seen_dir):
        os.remove(os.path.join(seen_dir, name))
    tuner = _search(tmp_path, "devices")
    assert_same_trials(reference, tuner)

    # Each trial's path names the worker that trained it, and that worker's own path.
    paths = tuner.trial_paths()
    assert sorted(paths, key=int) == [str(i) for i in range(6)]
    assert {p["worker"] for p in paths.values()} == {"gpu0", "gpu1"}
    assert all(p["path"] in ("fused", "graph", "slot") for p in paths.values()), paths
    # Each worker saw only its own device: the environment it was started with.
    notes = list(th.seen(seen_dir).values())
    by_lr = {note["lr"]: note for note in notes}
    for trial_id, trial in tuner.oracle.trials.items():
        note = by_lr[trial.hyperparameters.get("lr")]
        worker = paths[trial_id]["worker"]
        assert note["worker"] == worker
        assert note["visible"] == {"gpu0": "0", "gpu1": "1"}[worker]
    tuner.results_summary(6)
    printed = capsys.readouterr().out
    assert printed.count("Path: ") == 6 and printed.count(" (worker gpu") == 6, printed


# A worker's restart is the processes executor's own code, whatever the workers train on.
@slow_off_tensorflow
def test_a_device_worker_killed_mid_trial_is_restarted_and_the_search_ends_exact(
    tmp_path, seen_dir, caplog
):
    marker = str(tmp_path / "kill-marker")
    with caplog.at_level(logging.INFO, logger="keras_gpushare.tuner"):
        tuner = _search(tmp_path, "killed", callbacks=[th.KillSelf(marker, epoch=0)])
    assert os.path.exists(marker)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "killed by signal 9" in messages and "will run again" in messages
    trials = tuner.oracle.trials
    assert sorted(trials, key=int) == [str(i) for i in range(6)]
    assert all(t.status == "COMPLETED" for t in trials.values())


def test_a_devices_search_ended_by_failures_keeps_its_paths_and_its_workers_quiet(
    tmp_path, capfd, caplog
):
    """Too many consecutive failed trials end the search with KerasTuner's error, and each
    trial keeps the path it took, as in one process; the workers told that the search
    ended stop without a gRPC traceback."""
    paths, printed = {}, {}
    for name, devices in (("one", None), ("devices", ["cpu0", "cpu1"])):
        tuner = kg.tuner.ParallelTuner(
            th.build_failing_from_2,
            oracle=keras_tuner.oracles.GridSearchOracle(
                objective="val_loss", max_consecutive_failed_trials=2
            ),
            parallel_trials=2,
            devices=devices,
            directory=str(tmp_path),
            project_name=name,
        )
        with pytest.raises(RuntimeError, match="Number of consecutive failures exceeded"):
            tuner.search(*th.data(64), epochs=1, validation_split=0.25, verbose=0)
        trials = tuner.oracle.trials
        assert "RUNNING" not in {t.status for t in trials.values()}
        paths[name] = {
            trials[trial_id].hyperparameters["value"]: {k: v for k, v in p.items() if k != "worker"}
            for trial_id, p in tuner.trial_paths().items()
        }
        assert sorted(paths[name]) == sorted(t.hyperparameters["value"] for t in trials.values())
        searched = capfd.readouterr()
        tuner.results_summary(5)
        printed[name] = (searched.out + searched.err, capfd.readouterr().out)
    for value, path in paths["devices"].items():
        if value >= 2:
            assert path == {
                "path": "not trained",
                "why": f"building its model raised FailedTrialError: wrong value {value}.",
            }
            assert path == paths["one"].get(value, path)
    searched, summary = printed["devices"]
    assert summary.count("Path: not trained (worker cpu") == len(paths["devices"]) - 1, summary
    assert "_InactiveRpcError" not in searched
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("grpc")]


@slow_on_tensorflow  # the default executor there asks a round at a time: no such wait
def test_a_devices_grid_search_runs_every_combination_as_keras_tuner(tmp_path):
    """GridSearch holds its next combination back (IDLE) until the trials running end; a
    worker streaming trials through slots asks for a free slot's trial while its own trials
    have not ended, and must take IDLE as "none yet" then, not wait for it: it waited (the
    oracle waiting for its trial, it for the oracle), and the search never ended."""
    space = keras_tuner.HyperParameters()
    space.Choice("lr", [0.003, 0.01, 0.03, 0.1])
    space.Fixed("units", 4)
    scores = {}
    for name in ("kt", "devices"):
        args = dict(
            hypermodel=th.build_mlp,
            oracle=keras_tuner.oracles.GridSearchOracle(
                objective="val_loss", hyperparameters=space
            ),
            directory=str(tmp_path),
            project_name=name,
        )
        if name == "kt":
            tuner = keras_tuner.Tuner(**args)
        else:
            # Slots on either backend (the default on JAX; TensorFlow's is packs).
            devices = ["cpu0", "cpu1"]
            tuner = kg.tuner.ParallelTuner(
                parallel_trials=2, devices=devices, executor="slots", **args
            )
        tuner.search(*th.data(), **FIT)
        trials = tuner.oracle.trials.values()
        assert {t.status for t in trials} == {"COMPLETED"}
        scores[name] = {t.hyperparameters["lr"]: t.score for t in trials}
    assert sorted(scores["devices"]) == sorted(scores["kt"]) == [0.003, 0.01, 0.03, 0.1]
    for lr, score in scores["kt"].items():
        np.testing.assert_allclose(scores["devices"][lr], score, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "devices, executor, message",
    [
        ("every", "auto", "Invalid value for argument `devices`"),
        ([], "auto", "Invalid value for argument `devices`"),
        ([0, 0], "auto", "distinct GPU indices"),
        ([0, 1], "processes", '`devices` with executor="processes"'),
    ],
)
def test_bad_devices_are_refused_before_any_work(tmp_path, devices, executor, message):
    with pytest.raises(ValueError, match=message):
        kg.tuner.ParallelTuner(
            th.build_mlp,
            objective="val_loss",
            max_trials=1,
            devices=devices,
            executor=executor,
            directory=str(tmp_path),
        )
    assert not os.listdir(tmp_path)


def _tuner(tmp_path, devices):
    return kg.tuner.ParallelTuner(
        th.build_mlp,
        objective="val_loss",
        max_trials=1,
        devices=devices,
        directory=str(tmp_path),
        project_name="checked",
    )


@pytest.mark.parametrize("devices", [[9], ["gpu9"], [0, "GPU-ffffffff"], ["MIG-00000000"]])
def test_devices_naming_no_gpu_are_refused_listing_the_gpus_there_are(tmp_path, nvml, devices):
    gpus = h100s(2)
    nvml(gpus)
    with pytest.raises(ValueError, match="Invalid value for argument `devices`") as info:
        _tuner(tmp_path, devices)
    message = str(info.value)
    wrong = str(devices[-1])
    if wrong.startswith(("GPU-", "MIG-")):
        assert f"no GPU of this machine has UUID {wrong!r}" in message
    else:
        assert f"there is no GPU {wrong.replace('gpu', '')} on this machine" in message
    assert all(f"{gpu.index}: {gpu.uuid} ({gpu.name})" in message for gpu in gpus), message
    assert not os.listdir(tmp_path)


def test_devices_name_gpus_by_index_worker_name_or_uuid_prefix(tmp_path, nvml):
    gpus = h100s(2)
    nvml(gpus)
    tuner = _tuner(tmp_path, ["gpu0", gpus[1].uuid[:12], "cpu0"])
    assert tuner.devices == ("0", gpus[1].uuid[:12], "cpu0")


def test_gpu_entries_without_a_gpu_warn_once_that_workers_train_on_the_cpu(tmp_path, nvml):
    nvml([], init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tuner(tmp_path, [0, "gpu1", "cpu2"])
        said = [str(w.message) for w in caught if "found no GPU" in str(w.message)]
        assert len(said) == 1, said
        assert "workers gpu0, gpu1 will train on the CPU" in said[0]
        caught.clear()
        _tuner(tmp_path, ["cpu0", "cpu1"])
        assert not [w for w in caught if "GPU" in str(w.message)]
