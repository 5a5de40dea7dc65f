"""ParallelTuner with executor="pack": real searches on tiny data."""

import os

import keras
import keras_tuner
import numpy as np
import pytest
import tuner_helpers as th

import keras_gpushare as kg


def off_jax(test):
    """`test`, marked `slow` on JAX: the pack executor's own handling of trials (Python,
    the same on every backend) is tested in `make test` on TensorFlow, where it is the
    default; on JAX, whose default is "slots", `make test` keeps its random search and
    argument checks."""
    return pytest.mark.slow(test) if keras.backend.backend() == "jax" else test


def _search(tmp_path, name, oracle=None, build=th.build_mlp, callbacks=None, **kwargs):
    tuner = kg.tuner.ParallelTuner(
        build,
        oracle=oracle,
        parallel_trials=kwargs.pop("parallel_trials", 4),
        executor=kwargs.pop("executor", "pack"),
        directory=str(tmp_path),
        project_name=name,
        **kwargs,
    )
    x, y = th.data()
    tuner.search(
        x, y, epochs=3, validation_split=0.25, verbose=0, shuffle=False, callbacks=callbacks or []
    )
    return tuner


def test_random_search_runs_every_trial_with_its_own_results(tmp_path):
    tuner = _search(tmp_path, "random", objective="val_loss", max_trials=6, seed=3)
    project = os.path.join(tmp_path, "random")
    states = th.trial_states(project)
    assert sorted(states) == [str(i) for i in range(6)]
    assert all(status == "COMPLETED" for status, _ in states.values())
    for trial_id in states:
        trial_dir = os.path.join(project, f"trial_{trial_id}")
        assert os.path.exists(os.path.join(trial_dir, "checkpoint.weights.h5"))
        assert os.path.exists(os.path.join(trial_dir, "build_config.json"))
        trial = tuner.oracle.get_trial(trial_id)
        # One report, as KerasTuner's run_trial makes it: the best epoch, at its step.
        assert len(trial.metrics.get_history("val_loss")) == 1
        assert trial.metrics.get_history("val_loss")[0].step == trial.best_step
    assert sorted(th.oracle_state(project)["end_order"]) == sorted(states)
    assert th.oracle_state(project)["ongoing_trials"] == {}
    best = tuner.get_best_models(1)[0]
    x, y = th.data()
    best_trial = tuner.oracle.get_best_trials(1)[0]
    assert best_trial.score == min(score for _, score in states.values())
    # The checkpoint holds the best epoch's weights: evaluating it gives that val_loss.
    val_loss = best.evaluate(x[96:], y[96:], verbose=0)[0]
    np.testing.assert_allclose(val_loss, best_trial.score, rtol=1e-3)
    assert tuner.get_best_hyperparameters(1)[0].values == best_trial.hyperparameters.values


@off_jax
def test_hyperband_promotes_trials_from_their_parents_weights(tmp_path):
    oracle = keras_tuner.oracles.HyperbandOracle(
        objective="val_loss", max_epochs=3, factor=3, seed=2
    )
    tuner = _search(tmp_path, "hyperband", oracle=oracle)
    trials = tuner.oracle.trials.values()
    assert all(t.status == "COMPLETED" for t in trials)
    promoted = [t for t in trials if "tuner/trial_id" in t.hyperparameters.values]
    assert promoted, "Hyperband should have promoted at least one trial"
    for trial in promoted:
        parent = tuner.oracle.get_trial(trial.hyperparameters.values["tuner/trial_id"])
        # Trained on from the parent's best weights, for the epochs left in its budget.
        values = trial.hyperparameters.values
        budget = values["tuner/epochs"] - values["tuner/initial_epoch"]
        assert trial.best_step < budget
        assert parent.status == "COMPLETED"


@off_jax
def test_failing_trials_fail_alone_and_the_pack_completes(tmp_path):
    hp = keras_tuner.HyperParameters()
    hp.Choice("mode", ["ok", "raise", "diverge", "ok2"])
    oracle = keras_tuner.oracles.GridSearchOracle(objective="val_loss", hyperparameters=hp)
    tuner = _search(tmp_path, "failing", oracle=oracle, build=th.build_sometimes_broken)
    by_mode = {t.hyperparameters["mode"]: t for t in tuner.oracle.trials.values()}
    assert sorted(by_mode) == ["diverge", "ok", "ok2", "raise"]
    assert by_mode["ok"].status == by_mode["ok2"].status == "COMPLETED"
    assert by_mode["raise"].status == "FAILED"
    assert "broken trial" in by_mode["raise"].message
    # As in KerasTuner: a loss that is NaN from the first epoch makes the score NaN, so the
    # trial is INVALID, then FAILED (no retries by default).
    assert by_mode["diverge"].status == "FAILED"
    assert np.isfinite(by_mode["ok"].score) and np.isfinite(by_mode["ok2"].score)


class _StopWideModels(keras.callbacks.Callback):
    """Stops a model with 8 hidden units after its first epoch; records the epochs seen."""

    seen: list = []

    def on_epoch_end(self, epoch, logs=None):
        assert "val_loss" in logs and not any(k.startswith("m0_") for k in logs)
        units = self.model.layers[0].units
        _StopWideModels.seen.append((units, epoch))
        if units == 8:
            self.model.stop_training = True


@off_jax
def test_a_callback_stops_only_its_own_trial(tmp_path):
    _StopWideModels.seen = []
    tuner = _search(
        tmp_path,
        "stopping",
        objective="val_loss",
        max_trials=4,
        seed=11,
        callbacks=[_StopWideModels()],
    )
    units = [t.hyperparameters["units"] for t in tuner.oracle.trials.values()]
    expected = sorted((u, e) for u in units for e in ([0] if u == 8 else [0, 1, 2]))
    assert sorted(_StopWideModels.seen) == expected
    assert set(units) == {4, 8}


def _optimizer_steps(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


class _OptimizerSteps(keras.callbacks.Callback):
    """Records the optimizer step count its model shows at each epoch end."""

    seen: list = []

    def on_epoch_end(self, epoch, logs=None):
        _OptimizerSteps.seen.append((epoch, _optimizer_steps(self.model)))


class _TunerReadingOptimizers(kg.tuner.ParallelTuner):
    seen: list = []

    def on_epoch_end(self, trial, model, epoch, logs=None):
        _TunerReadingOptimizers.seen.append((epoch, _optimizer_steps(model)))
        super().on_epoch_end(trial, model, epoch, logs=logs)


@off_jax
def test_callbacks_and_tuner_hooks_see_their_trials_optimizer_state(tmp_path):
    # 96 training samples, batch size 32: as plain `fit`, 3 optimizer steps an epoch.
    expected = sorted((epoch, 3 * (epoch + 1)) for epoch in range(3) for _ in range(2))
    _OptimizerSteps.seen = []
    _search(
        tmp_path,
        "callback-state",
        objective="val_loss",
        max_trials=2,
        callbacks=[_OptimizerSteps()],
    )
    assert sorted(_OptimizerSteps.seen) == expected
    _TunerReadingOptimizers.seen = []
    x, y = th.data()
    tuner = _TunerReadingOptimizers(
        th.build_mlp,
        objective="val_loss",
        max_trials=2,
        parallel_trials=2,
        directory=str(tmp_path),
        project_name="hook-state",
    )
    tuner.search(x, y, epochs=3, validation_split=0.25, verbose=0, shuffle=False)
    assert sorted(_TunerReadingOptimizers.seen) == expected


def test_invalid_arguments_raise_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="`executor`: got 'threads'"):
        kg.tuner.ParallelTuner(th.build_mlp, objective="val_loss", executor="threads")
    with pytest.raises(ValueError, match="`parallel_trials`: got 0"):
        kg.tuner.ParallelTuner(th.build_mlp, objective="val_loss", parallel_trials=0)
    oracle = keras_tuner.oracles.RandomSearchOracle(objective="val_loss", max_trials=2)
    with pytest.raises(ValueError, match=r"together with \['objective'\]"):
        kg.tuner.ParallelTuner(th.build_mlp, oracle=oracle, objective="val_loss")

    with pytest.raises(ValueError, match=r"together with \['max_retries_per_trial'\]"):
        kg.tuner.ParallelTuner(th.build_mlp, oracle=oracle, max_retries_per_trial=1)
    with pytest.raises(ValueError, match="Unrecognized arguments"):
        kg.tuner.ParallelTuner(th.build_mlp, objective="val_loss", unknown=3)
    assert not os.listdir(tmp_path)


def test_oracle_arguments_configure_the_default_oracle(tmp_path):
    """RandomSearch's oracle arguments (item 16): retries and consecutive failures."""
    space = keras_tuner.HyperParameters()
    space.Choice("units", [4])
    tuner = kg.tuner.ParallelTuner(
        th.build_mlp,
        objective="val_loss",
        max_trials=3,
        max_retries_per_trial=2,
        max_consecutive_failed_trials=5,
        hyperparameters=space,
        tune_new_entries=False,
        directory=str(tmp_path),
    )
    inner = tuner.oracle.oracle
    assert isinstance(inner, keras_tuner.oracles.RandomSearchOracle)
    assert (inner.max_retries_per_trial, inner.max_consecutive_failed_trials) == (2, 5)
    assert inner.tune_new_entries is False


@off_jax
def test_a_pack_whose_fit_raises_retrains_its_trials_alone(tmp_path, caplog):
    hp = keras_tuner.HyperParameters()
    hp.Choice("mode", ["ok", "bad", "ok2"])
    oracle = keras_tuner.oracles.GridSearchOracle(objective="val_loss", hyperparameters=hp)
    tuner = _search(tmp_path, "wrong-input", oracle=oracle, build=th.build_wrong_input)
    by_mode = {t.hyperparameters["mode"]: t for t in tuner.oracle.trials.values()}
    assert by_mode["ok"].status == by_mode["ok2"].status == "COMPLETED"
    assert by_mode["bad"].status == "FAILED"
    assert "training each trial alone" in caplog.text


@off_jax
def test_trials_of_other_lengths_train_in_packs_of_their_own(tmp_path):
    # Hyperband's first round mixes trials of 1, 3 and 9 epochs: in one pack, most of its
    # steps would compute trials that have ended, so each length gets its own pack.
    oracle = keras_tuner.oracles.HyperbandOracle(
        objective="val_loss", max_epochs=9, factor=3, seed=2
    )
    tuner = _search(tmp_path, "lengths", oracle=oracle, parallel_trials=16)
    paths = tuner.trial_paths()
    first_round = [
        t
        for t in tuner.oracle.trials.values()
        if t.hyperparameters.values.get("tuner/initial_epoch", 0) == 0
    ]
    lengths = {t.hyperparameters.values["tuner/epochs"] for t in first_round}
    assert len(lengths) > 1
    for trial in first_round:
        # "trials 3, 4, 7 (batch size 64)": the trials trained in this trial's pack.
        label = paths[trial.trial_id]["pack"].split(" (")[0]
        packed_with = label.split(" ", 1)[1].split(", ")
        lengths = {
            tuner.oracle.get_trial(t).hyperparameters.values["tuner/epochs"] for t in packed_with
        }
        assert lengths == {trial.hyperparameters.values["tuner/epochs"]}
        assert trial.status == "COMPLETED"
