"""The processes executor at its seam: its `run` driven with a fake feed, no tuner in this process.

As the chief (a local feed), `run` serves the oracle and starts one worker process, which
rebuilds the tuner from its class and arguments and runs both trials there; `run` returns
when the search is done and records the `"worker"` path for them through the feed. As a
worker (a remote feed), it hands the trials to KerasTuner's loop, one at a time.
"""

import keras_tuner
import tuner_helpers as th

import keras_gpushare as kg
from keras_gpushare import _upstream
from keras_gpushare.tuner._executor import TrialFeed
from keras_gpushare.tuner._process_executor import ProcessExecutor, WorkerLaunch


def _unused(*args, **kwargs):
    raise AssertionError("the processes executor's chief asked its feed for trials")


def test_the_chief_runs_the_trials_in_a_worker_process_and_records_their_path(tmp_path):
    oracle = kg.tuner.ParallelOracle(
        keras_tuner.oracles.RandomSearchOracle(objective="val_loss", max_trials=2, seed=1)
    )
    _upstream.set_oracle_project_dir(oracle, str(tmp_path), "seam")
    init_kwargs = dict(
        hypermodel=th.build_mlp,
        objective="val_loss",
        max_trials=2,
        seed=1,
        executor="processes",
        parallel_trials=1,
        directory=str(tmp_path),
        project_name="seam",
    )
    launch = WorkerLaunch(1, None, kg.tuner.ParallelTuner, (), init_kwargs)
    recorded = []
    feed = TrialFeed(
        1,
        _unused,
        _unused,
        one_at_a_time=_unused,
        record_ended=lambda path, reported: recorded.append((path, reported)),
    )

    x, y = th.data(64)
    fit_kwargs = dict(epochs=1, validation_split=0.25, verbose=0)
    ProcessExecutor(oracle, "tuner0", launch).run(feed, (x, y), fit_kwargs)

    assert sorted(oracle.end_order) == ["0", "1"]
    assert all(t.status == "COMPLETED" and t.score is not None for t in oracle.trials.values())
    why = 'a worker process (executor="processes") ran it alone with KerasTuner\'s `run_trial`'
    assert [path for path, _ in recorded] == [{"path": "worker", "why": why}]
    # The worker reported each trial's own path with its end, naming itself.
    reported = recorded[0][1]
    assert sorted(reported) == ["0", "1"]
    alone = "worker process worker0 ran it alone with KerasTuner's `run_trial`"
    assert all(
        p == {"path": "worker", "why": alone, "worker": "worker0"} for p in reported.values()
    )


def test_a_worker_runs_its_trials_one_at_a_time_with_keras_tuners_loop():
    ran = []
    feed = TrialFeed(
        1,
        _unused,
        _unused,
        remote=True,
        one_at_a_time=lambda path, *fit: ran.append((path, fit)),
        record_ended=_unused,
    )
    launch = WorkerLaunch(1, None, kg.tuner.ParallelTuner, (), {})
    ProcessExecutor(None, "worker0", launch).run(feed, ("x",), {"epochs": 1})

    why = "worker process worker0 ran it alone with KerasTuner's `run_trial`"
    assert ran == [({"path": "worker", "why": why}, (("x",), {"epochs": 1}))]
