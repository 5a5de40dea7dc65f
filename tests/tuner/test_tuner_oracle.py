"""ParallelOracle: trials K at a time, no lock left held, no busy waiting on IDLE."""

import threading

import keras_tuner
import pytest
from hang_guard import HANG_GUARD_S

import keras_gpushare as kg


def _oracle(tmp_path, inner, k=None):
    oracle = kg.tuner.ParallelOracle(inner, parallel_trials=k)
    oracle._set_project_dir(str(tmp_path), "oracle")
    space = keras_tuner.HyperParameters()
    space.Float("x", 0.0, 1.0)
    oracle.update_space(space)
    return oracle


def test_hands_out_at_most_k_trials(tmp_path):
    inner = keras_tuner.oracles.RandomSearchOracle(objective="loss", max_trials=10, seed=1)
    oracle = _oracle(tmp_path, inner, k=2)
    statuses = [oracle.create_trial(f"t{i}").status for i in range(3)]
    assert statuses == ["RUNNING", "RUNNING", "IDLE"]
    assert len(oracle.ongoing_trials) == 2


def test_lock_is_released_when_the_oracle_raises(tmp_path):
    inner = keras_tuner.oracles.RandomSearchOracle(objective="loss", max_trials=10, seed=1)
    oracle = _oracle(tmp_path, inner)
    trial = oracle.create_trial("t0")
    with pytest.raises(ValueError, match="Objective value missing"):
        oracle.update_trial(trial.trial_id, {"accuracy": 1.0})
    result = {}
    thread = threading.Thread(target=lambda: result.update(t=oracle.create_trial("t1")))
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "create_trial from another thread hung on a leaked lock"
    assert result["t"].status == "RUNNING"


class _IdleWhileRunning(keras_tuner.oracles.RandomSearchOracle):
    """Answers IDLE while any trial runs, like Hyperband between rounds; keeps its answers.

    `idle_answered` is set at the first IDLE answer, `asked_again` at any later one.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.answers = []
        self.idle_answered = threading.Event()
        self.asked_again = threading.Event()

    def populate_space(self, trial_id):
        if self.ongoing_trials:
            (self.asked_again if self.idle_answered.is_set() else self.idle_answered).set()
            self.answers.append("IDLE")
            return {"status": "IDLE"}
        self.answers.append("RUNNING")
        return super().populate_space(trial_id)


def test_wait_for_trial_sleeps_until_a_trial_ends(tmp_path):
    inner = _IdleWhileRunning(objective="loss", max_trials=5, seed=1)
    oracle = _oracle(tmp_path, inner)
    first = oracle.create_trial("t0")
    got = {}

    def ask():
        got["trial"] = oracle.wait_for_trial("t1", timeout=HANG_GUARD_S)

    thread = threading.Thread(target=ask)
    thread.start()
    assert inner.idle_answered.wait(HANG_GUARD_S), "wait_for_trial never asked the oracle"
    # While the first trial runs, the waiter sleeps: a polling waiter would ask again.
    assert not inner.asked_again.wait(0.5), f"asked again while waiting: {inner.answers}"
    assert "trial" not in got
    oracle.update_trial(first.trial_id, {"loss": 0.5})
    first.status = "COMPLETED"
    oracle.end_trial(first)
    thread.join(HANG_GUARD_S)
    assert got["trial"].status == "RUNNING"
    # t0's ask, the waiter's IDLE answer, then one ask when the first trial ended.
    assert inner.answers == ["RUNNING", "IDLE", "RUNNING"]


def test_end_trial_saves_state_without_the_ended_trial(tmp_path):
    inner = keras_tuner.oracles.RandomSearchOracle(objective="loss", max_trials=10, seed=1)
    oracle = _oracle(tmp_path, inner)
    trial = oracle.create_trial("t0")
    oracle.update_trial(trial.trial_id, {"loss": 0.1})
    trial.status = "COMPLETED"
    oracle.end_trial(trial)
    reloaded = kg.tuner.ParallelOracle(
        keras_tuner.oracles.RandomSearchOracle(objective="loss", max_trials=10, seed=1)
    )
    reloaded._set_project_dir(str(tmp_path), "oracle")
    reloaded.reload()
    assert reloaded.ongoing_trials == {}
    assert reloaded._retry_queue == []
    assert reloaded.get_trial(trial.trial_id).status == "COMPLETED"


def test_rejects_what_is_not_an_oracle():
    with pytest.raises(TypeError, match="expected a `keras_tuner.Oracle`"):
        kg.tuner.ParallelOracle("random")
    inner = keras_tuner.oracles.RandomSearchOracle(objective="loss", max_trials=1)
    with pytest.raises(ValueError, match="`parallel_trials`: got 0"):
        kg.tuner.ParallelOracle(inner, parallel_trials=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras_tuner.oracles.RandomSearchOracle(objective="loss", max_trials=2),
        lambda: keras_tuner.oracles.HyperbandOracle(objective="loss", max_epochs=4),
        lambda: keras_tuner.oracles.GridSearchOracle(objective="loss"),
    ],
    ids=["random", "hyperband", "grid"],
)
def test_the_oracle_is_an_instance_of_the_class_it_wraps(make):
    """`isinstance(tuner.oracle, HyperbandOracle)` holds as in KerasTuner (KerasTuner's own
    tests check it): the wrapper's class subclasses the wrapped one's, made once per class,
    with no `__class__` trick; what it wraps is `.oracle`."""
    inner = make()
    oracle = kg.tuner.ParallelOracle(inner)
    assert isinstance(oracle, type(inner))
    assert isinstance(oracle, kg.tuner.ParallelOracle)
    assert type(oracle) is oracle.__class__ is type(kg.tuner.ParallelOracle(make()))
    assert type(oracle).__name__ == f"Parallel{type(inner).__name__}"
    assert oracle.oracle is inner
    assert type(oracle).create_trial is kg.tuner.ParallelOracle.create_trial


def test_the_oracle_says_what_it_is(tmp_path):
    """A ParallelOracle is a `keras_tuner.Oracle` (KerasTuner's own check, in `BaseTuner`);
    the oracle it wraps is `.oracle`."""
    inner = keras_tuner.oracles.HyperbandOracle(objective="loss", max_epochs=4)
    oracle = kg.tuner.ParallelOracle(inner)
    assert isinstance(oracle, keras_tuner.Oracle)
    assert isinstance(oracle.oracle, keras_tuner.oracles.HyperbandOracle)
    tuner = keras_tuner.Tuner(oracle=oracle, hypermodel=lambda hp: None, directory=str(tmp_path))
    assert tuner.oracle is oracle


def test_no_trial_repeats_the_values_of_a_running_one(tmp_path):
    """With 4 trials in flight KerasTuner's BayesianOptimization oracle proposes the values
    of a running trial (5 of 14 trials here); wrapped, it is asked again, then a value set
    never handed out is drawn: no slot trains a duplicate."""
    pytest.importorskip("sklearn")
    space = keras_tuner.HyperParameters()
    space.Int("units", 1, 4)
    space.Choice("activation", ["relu", "tanh"])
    inner = keras_tuner.oracles.BayesianOptimizationOracle(
        objective=keras_tuner.Objective("score", "max"),
        max_trials=14,
        num_initial_points=2,
        hyperparameters=space,
        seed=3,
    )
    oracle = kg.tuner.ParallelOracle(inner)
    oracle._set_project_dir(str(tmp_path), "bayesian")
    running: dict = {}
    made = []
    while True:
        for tuner_id in ("t0", "t1", "t2", "t3"):
            if tuner_id not in running:
                trial = oracle.create_trial(tuner_id)
                if trial.status == "RUNNING":
                    others = [t.hyperparameters.values for t in running.values()]
                    assert trial.hyperparameters.values not in others
                    running[tuner_id] = trial
                    made.append(trial)
        if not running:
            break
        trial = running.pop(next(iter(running)))  # the oldest ends
        values = trial.hyperparameters.values
        score = values["units"] * (2 if values["activation"] == "relu" else 1)
        oracle.update_trial(trial.trial_id, {"score": score})
        trial.status = "COMPLETED"
        oracle.end_trial(trial)
    assert len(made) == 14
