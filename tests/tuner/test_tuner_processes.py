"""ParallelTuner with executor="processes": workers, restarts, and a second launch joining."""

import json
import logging
import os
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import keras_tuner
import pytest
import tuner_helpers as th
from hang_guard import HANG_GUARD_S

import keras_gpushare as kg
from keras_gpushare import _upstream
from keras_gpushare.tuner import _process_executor

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "tuner_search_script.py")


def _search(tmp_path, name, oracle=None, callbacks=None, **kwargs):
    tuner = kg.tuner.ParallelTuner(
        th.build_mlp,
        oracle=oracle,
        executor="processes",
        parallel_trials=2,
        directory=str(tmp_path),
        project_name=name,
        **kwargs,
    )
    x, y = th.data()
    tuner.search(x, y, epochs=2, validation_split=0.25, verbose=0, callbacks=callbacks or [])
    return tuner


def test_random_search_in_worker_processes(tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="keras_gpushare.tuner"):
        tuner = _search(tmp_path, "random", objective="val_loss", max_trials=4, seed=3)
    project = os.path.join(tmp_path, "random")
    states = th.trial_states(project)
    assert sorted(states) == ["0", "1", "2", "3"]
    assert all(status == "COMPLETED" for status, _ in states.values())
    # Local workers keep no state file of their own: the project folder is KerasTuner's.
    assert not {"worker0.json", "worker1.json"} & set(os.listdir(project))
    finished = [r.getMessage() for r in caplog.records if "COMPLETED in" in r.getMessage()]
    assert len(finished) == 4 and all("'units'" in line for line in finished)
    assert tuner.get_best_models(1)[0].count_params() > 0

    # The finished project, reloaded, has nothing to run: no worker process starts.
    def no_worker(*args, **kwargs):
        raise AssertionError("a worker process was started for a finished search")

    monkeypatch.setattr(_process_executor.subprocess, "Popen", no_worker)
    reloaded = _search(tmp_path, "random", objective="val_loss", max_trials=4, seed=3)
    assert sorted(reloaded.oracle.end_order) == ["0", "1", "2", "3"]


def test_a_worker_falls_back_to_keras_tuner_calls_with_a_plain_keras_tuner_chief(
    tmp_path, monkeypatch
):
    """`ChiefClient` against KerasTuner's own servicer (no `keras_gpushare.tuner.Trials`)."""
    from keras_tuner.src.distribute import oracle_client

    oracle = keras_tuner.oracles.RandomSearchOracle(objective="val_loss", max_trials=1, seed=1)
    _upstream.set_oracle_project_dir(oracle, str(tmp_path), "plain")
    hp = keras_tuner.HyperParameters()
    hp.Choice("units", [4, 8])
    oracle.update_space(hp)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _upstream.oracle_servicer_class()(oracle)
    _upstream.kt_protos().get_service_grpc().add_OracleServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("KERASTUNER_ORACLE_IP", "127.0.0.1")
    monkeypatch.setenv("KERASTUNER_ORACLE_PORT", str(port))
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "worker0")
    try:
        client = _process_executor.chief_client(oracle_client.OracleClient(oracle))
        trial = client.create_trial("worker0")
        assert trial.status == "RUNNING" and "units" in trial.hyperparameters.values
        client.update_trial(trial.trial_id, {"val_loss": 0.5}, step=0)
        trial.status = "COMPLETED"
        client.end_trial(trial)
    finally:
        server.stop(grace=None)
    assert oracle.trials[trial.trial_id].status == "COMPLETED"
    assert oracle.trials[trial.trial_id].score == 0.5


def test_a_worker_told_that_the_search_ended_stops_quietly(tmp_path, monkeypatch, caplog):
    """The chief's oracle raises as trials end (too many consecutive failed trials): each
    `end_trial` of the worker returns, the worker says so in one INFO line, and its next
    ask is STOPPED; the error stays the chief's to raise, not a gRPC traceback here."""
    from keras_tuner.src.distribute import oracle_client

    oracle = kg.tuner.ParallelOracle(
        keras_tuner.oracles.RandomSearchOracle(
            objective="val_loss", max_trials=4, seed=1, max_consecutive_failed_trials=1
        )
    )
    _upstream.set_oracle_project_dir(oracle, str(tmp_path), "ended")
    hp = keras_tuner.HyperParameters()
    hp.Float("lr", 1e-3, 1e-1)
    oracle.update_space(hp)
    server, port, _ = _process_executor._start_server(oracle, "127.0.0.1:0", threads=2)
    monkeypatch.setenv("KERASTUNER_ORACLE_IP", "127.0.0.1")
    monkeypatch.setenv("KERASTUNER_ORACLE_PORT", str(port))
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "gpu0")
    try:
        client = _process_executor.chief_client(oracle_client.OracleClient(oracle))
        with caplog.at_level(logging.INFO, logger="keras_gpushare.tuner"):
            trials = [client.create_trial(f"gpu0-{slot}") for slot in (0, 1)]
            for trial in trials:
                trial.status = "FAILED"
                trial.message = "building its model raised"
                client.end_trial(trial)
            after = client.create_trial("gpu0-0")
    finally:
        server.stop(grace=None)
    assert after.status == "STOPPED"
    limit = "Number of consecutive failures exceeded the limit of 1."
    assert str(oracle.fatal_error).splitlines()[0] == limit
    assert {t.status for t in oracle.trials.values()} == {"FAILED"} and not oracle.ongoing_trials
    told = [r for r in caplog.records if "the chief ended the search" in r.getMessage()]
    assert [r.levelno for r in told] == [logging.INFO]
    assert told[0].getMessage() == (
        f"Worker gpu0: the chief ended the search (RuntimeError: {limit}); this worker "
        "stops once its running trials have ended."
    )


# `make test-all` only: Hyperband's brackets are the chief's oracle (as in
# test_conformance_results.py's Hyperband), the workers train trials as in the random search.
@pytest.mark.slow
def test_hyperband_in_worker_processes(tmp_path):
    oracle = keras_tuner.oracles.HyperbandOracle(
        objective="val_loss", max_epochs=2, factor=2, seed=2
    )
    tuner = _search(tmp_path, "hyperband", oracle=oracle)
    trials = list(tuner.oracle.trials.values())
    assert len(trials) >= 3
    assert all(t.status == "COMPLETED" for t in trials)
    assert any("tuner/trial_id" in t.hyperparameters.values for t in trials)


# `make test-all` only: a device worker (the same executor's worker) killed mid-trial is
# restarted in test_tuner_devices.py.
@pytest.mark.slow
def test_a_worker_killed_mid_trial_is_restarted_and_its_trial_rerun(tmp_path, caplog):
    marker = str(tmp_path / "kill-marker")
    with caplog.at_level(logging.INFO, logger="keras_gpushare.tuner"):
        tuner = _search(
            tmp_path,
            "killed",
            objective="val_loss",
            max_trials=3,
            seed=4,
            callbacks=[th.KillSelf(marker, epoch=0)],
        )
    assert os.path.exists(marker)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "killed by signal 9" in messages and "will run again" in messages
    trials = tuner.oracle.trials
    assert sorted(trials) == ["0", "1", "2"]
    assert all(t.status == "COMPLETED" for t in trials.values())
    assert sorted(tuner.oracle.end_order) == ["0", "1", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `make test` joins a second launch with the processes executor (the devices executor's is
# the same chief); the pack, slots and devices executors' joins run in `make test-all`.
@pytest.mark.parametrize(
    "executor",
    [
        "processes",
        pytest.param("pack", marks=pytest.mark.slow),
        pytest.param("slots", marks=pytest.mark.slow),
        pytest.param("devices", marks=pytest.mark.slow),
    ],
)
def test_a_second_launch_joins_the_chief_as_a_worker(tmp_path, executor):
    """KerasTuner's distributed tuning: a chief, and a worker started with the same script.

    With executor="processes" the chief also runs a local worker process; with
    executor="pack" (item 17) the chief only serves, as KerasTuner's does, and the worker
    runs its trials two at a time as packs; with executor="slots" the worker streams its
    trials through two slots of its own; with `devices` both launches start a worker per
    (CPU) device, the second one's joining the chief under `machine2-worker0-<device>`.
    """
    port = str(_free_port())
    base = {**os.environ, "KERASTUNER_ORACLE_IP": "127.0.0.1", "KERASTUNER_ORACLE_PORT": port}
    base["PYTHONPATH"] = os.pathsep.join([HERE, base.get("PYTHONPATH", "")])
    parallel = "1" if executor == "processes" else "2"
    args = [sys.executable, SCRIPT, str(tmp_path), executor, "6", parallel]
    chief = subprocess.Popen(args, env={**base, "KERASTUNER_TUNER_ID": "chief"})
    remote = subprocess.Popen(args, env={**base, "KERASTUNER_TUNER_ID": "machine2-worker0"})
    try:
        assert remote.wait(timeout=HANG_GUARD_S) == 0
        assert chief.wait(timeout=HANG_GUARD_S) == 0
    finally:
        for process in (chief, remote):
            if process.poll() is None:
                process.kill()
    project = os.path.join(tmp_path, "search")
    states = th.trial_states(project)
    assert sorted(states) == [str(i) for i in range(6)]
    assert all(status == "COMPLETED" for status, _ in states.values())
    assert "chief.json" in os.listdir(project)
    # A tuner that trains trials keeps its state file; the second machine's devices run
    # in its device workers, which keep none, as the chief's own do.
    assert ("machine2-worker0.json" in os.listdir(project)) == (executor != "devices")
    if executor == "processes":
        assert "worker0.json" not in os.listdir(project)
    if executor == "slots":
        with open(os.path.join(project, "machine2-worker0.json")) as f:
            paths = json.load(f)["trial_paths"]
        assert sorted(paths) == sorted(states)
        assert {path["path"] for path in paths.values()} == {"slot"}, paths
    if executor == "devices":
        with open(os.path.join(project, "chief.json")) as f:
            paths = json.load(f)["trial_paths"]
        workers = {"gpu0", "gpu1", "machine2-worker0-gpu0", "machine2-worker0-gpu1"}
        assert sorted(paths) == sorted(states)
        assert {path["worker"] for path in paths.values()} <= workers, paths
