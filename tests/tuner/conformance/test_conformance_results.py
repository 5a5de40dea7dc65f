"""ParallelTuner vs KerasTuner's own tuners on the same code: results, display, files, reload.

Each scenario runs one search with KerasTuner's tuner and with ParallelTuner at
parallel_trials 1 and 4 (executor="pack") and with two worker processes
(executor="processes"), once per module, and the tests compare what a user sees.
`make test` runs each scenario with the backend's default executor (kt_twins.PARALLEL),
the random search with both executors of a round and, on TensorFlow, the processes
executor; the processes executor's other scenarios are `slow` (each starts two worker
processes).
"""

import os
import re

import keras_tuner
import numpy as np
import pytest
from kt_twins import (
    EVERY_WITH_PROCESSES,
    PARALLEL,
    WITH_PROCESSES,
    ByKind,
    assert_same_trials,
    build_declaring,
    data,
    make,
    masked,
    printed,
    project_files,
    search,
    slow_off_tensorflow,
)

FIT = dict(epochs=2, validation_split=0.25, shuffle=False)
DISPLAY = re.compile(r"^(Search: Running Trial|Trial \d+ Complete|Best .* So Far|Total elapsed)")


def _run_all(root, name, fit=FIT, **make_kwargs):
    x, y = data()

    def run(kind):
        tuner = make(kind, directory=str(root), project_name=f"{name}-{kind}", **make_kwargs)
        return tuner, search(tuner, x, y, **fit)

    return ByKind(run)


@pytest.fixture(scope="module")
def random_search(tmp_path_factory):
    """KerasTuner's RandomSearch with its default verbose=1."""
    root = tmp_path_factory.mktemp("random")
    return _run_all(root, "random", objective="val_loss", max_trials=4, seed=3)


@pytest.mark.parametrize("k", EVERY_WITH_PROCESSES)
def test_random_search_trials_scores_and_metrics_match(random_search, k):
    reference, _ = random_search["kt"]
    tuner, _ = random_search[k]
    assert_same_trials(reference, tuner)
    assert all(t.status == "COMPLETED" for t in tuner.oracle.trials.values())


@pytest.mark.parametrize("k", EVERY_WITH_PROCESSES)
def test_verbose_display_matches(random_search, k):
    """A block per trial start and end, the best score so far: never `None` mid-round."""
    _, reference = random_search["kt"]
    _, out = random_search[k]

    def display(text):
        return sorted(line for line in masked(text) if DISPLAY.match(line))

    assert display(out) == display(reference)
    assert out.count("Search: Running Trial #") == 4
    assert sorted(re.findall(r"Trial (\d+) Complete", out)) == ["1", "2", "3", "4"]
    assert re.findall(r"Best val_loss So Far: (\S+)", out)
    assert "None" not in re.findall(r"Best val_loss So Far: (\S+)", out)


@pytest.mark.parametrize("k", EVERY_WITH_PROCESSES)
def test_results_api_matches(random_search, k):
    reference, _ = random_search["kt"]
    tuner, _ = random_search[k]
    # KerasTuner's summary, plus one `Path:` line a trial (`ParallelTuner.trial_paths`).
    ours = masked(printed(tuner.results_summary))
    paths = [line for line in ours if line.startswith("Path: ")]
    assert len(paths) == len([line for line in ours if line.startswith("Trial ")])
    assert [line for line in ours if line not in paths] == masked(
        printed(reference.results_summary)
    )
    assert masked(printed(tuner.search_space_summary)) == masked(
        printed(reference.search_space_summary)
    )
    assert [hp.values for hp in tuner.get_best_hyperparameters(4)] == [
        hp.values for hp in reference.get_best_hyperparameters(4)
    ]
    x, y = data()
    for mine, theirs in zip(tuner.get_best_models(2), reference.get_best_models(2)):
        np.testing.assert_allclose(
            mine.evaluate(x, y, verbose=0), theirs.evaluate(x, y, verbose=0), rtol=1e-4
        )
    assert tuner.remaining_trials == reference.remaining_trials == 0
    assert type(tuner.oracle.oracle) is type(reference.oracle)


@pytest.mark.parametrize("k", EVERY_WITH_PROCESSES)
def test_project_files_match(random_search, k):
    reference, _ = random_search["kt"]
    tuner, _ = random_search[k]
    assert project_files(tuner) == project_files(reference)
    ours = keras_tuner.src.utils.load_json(os.path.join(tuner.project_dir, "oracle.json"))
    theirs = keras_tuner.src.utils.load_json(os.path.join(reference.project_dir, "oracle.json"))
    assert set(theirs) <= set(ours)
    for key in ("end_order", "start_order", "run_times", "retry_queue", "ongoing_trials"):
        assert sorted(ours[key]) == sorted(theirs[key]), key


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """A finished project made again (reloads, runs nothing), then given a larger budget."""
    root = str(tmp_path_factory.mktemp("reload"))
    x, y = data()
    fit = dict(FIT, epochs=1, verbose=0)

    def run(kind):
        common = dict(objective="val_loss", seed=5, directory=root, project_name=str(kind))
        search(make(kind, max_trials=2, **common), x, y, **fit)
        made = []
        text = printed(lambda: made.append(make(kind, max_trials=2, **common)))
        text += search(made[0], x, y, **fit)
        more = make(kind, max_trials=3, **common)
        search(more, x, y, **fit)
        return more, text

    return ByKind(run)


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_reloading_resumes_like_keras_tuner(reloaded, k):
    tuner, text = reloaded[k]
    reference, expected = reloaded["kt"]
    assert "Reloading Tuner from" in text
    assert masked(text) == masked(expected)
    assert_same_trials(reference, tuner)
    assert len(tuner.oracle.trials) == 3


@pytest.fixture(scope="module")
def grid_multi_objective(tmp_path_factory):
    """GridSearch over 4 values with a multi-objective objective."""
    hp = keras_tuner.HyperParameters()
    hp.Choice("units", [2, 4])
    hp.Choice("lr", [0.01, 0.1])
    return _run_all(
        tmp_path_factory.mktemp("grid"),
        "grid",
        fit=dict(FIT, epochs=1, verbose=0),
        oracle=keras_tuner.oracles.GridSearchOracle,
        base_kt=keras_tuner.GridSearch,
        objective=["val_accuracy", "val_loss"],
        hyperparameters=hp,
    )


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_grid_search_with_multi_objective_matches(grid_multi_objective, k):
    reference, _ = grid_multi_objective["kt"]
    tuner, _ = grid_multi_objective[k]
    assert_same_trials(reference, tuner)
    assert len(tuner.oracle.trials) == 4
    assert all(t.metrics.exists("multi_objective") for t in tuner.oracle.trials.values())


@pytest.fixture(scope="module")
def hyperband(tmp_path_factory):
    return _run_all(
        tmp_path_factory.mktemp("hyperband"),
        "hyperband",
        fit=dict(validation_split=0.25, shuffle=False, verbose=0),
        oracle=keras_tuner.oracles.HyperbandOracle,
        base_kt=keras_tuner.Hyperband,
        objective="val_loss",
        max_epochs=2,
        factor=2,
        seed=4,
    )


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_hyperband_matches(hyperband, k):
    """Brackets, epoch budgets, promotions from the parent's checkpoint."""
    reference, _ = hyperband["kt"]
    tuner, _ = hyperband[k]
    ours, theirs = tuner.oracle.trials, reference.oracle.trials
    if k == 1:
        assert_same_trials(reference, tuner)
    else:
        # Trials running at once change which trial Hyperband promotes when (it promotes
        # as soon as enough candidates are done); compare what must agree.
        assert len(ours) == len(theirs)
        assert all(t.status == "COMPLETED" for t in ours.values())
        budget = sorted(t.hyperparameters.values["tuner/epochs"] for t in ours.values())
        assert budget == sorted(t.hyperparameters.values["tuner/epochs"] for t in theirs.values())
    assert any("tuner/trial_id" in t.hyperparameters.values for t in ours.values())


# The oracle's own work (growing the space, Bayesian optimization) is backend-neutral: on
# TensorFlow in `make test`, on JAX with the slow tests.
@slow_off_tensorflow
@pytest.mark.parametrize("k", PARALLEL)
def test_hyperparameters_a_build_declares_reach_the_next_trials(tmp_path, k):
    """A hyperparameter first declared by a trial's build (the second layer's width)
    is drawn for the trials made after that trial, as KerasTuner's loop draws it; the
    trials of a round are made one by one, each built before the next is made."""
    runs = _run_all(
        tmp_path,
        "declaring",
        fit=dict(FIT, verbose=0),
        hypermodel=build_declaring,
        objective="val_loss",
        max_trials=6,
        seed=4,
    )
    reference, tuner = runs["kt"][0], runs[k][0]
    assert_same_trials(reference, tuner)
    declared = [t for t in tuner.oracle.trials.values() if "units_1" in t.hyperparameters]
    assert declared


@pytest.fixture(scope="module")
def compile_overrides(tmp_path_factory):
    """The tuner's `optimizer`, `loss` and `metrics` replace the hypermodel's."""
    return _run_all(
        tmp_path_factory.mktemp("overrides"),
        "overrides",
        fit=dict(FIT, epochs=1, verbose=0),
        objective="val_mae",
        max_trials=2,
        seed=1,
        optimizer="adam",
        loss="mse",
        metrics=["mae"],
    )


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_compile_overrides_match(compile_overrides, k):
    reference, _ = compile_overrides["kt"]
    tuner, _ = compile_overrides[k]
    assert_same_trials(reference, tuner)
    assert tuner.get_best_models()[0].loss == "mse"


@slow_off_tensorflow
@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_bayesian_optimization_matches(tmp_path, k):
    pytest.importorskip("sklearn")
    runs = _run_all(
        tmp_path,
        "bayesian",
        fit=dict(FIT, verbose=0),
        oracle=keras_tuner.oracles.BayesianOptimizationOracle,
        base_kt=keras_tuner.BayesianOptimization,
        objective="val_loss",
        max_trials=4,
        num_initial_points=2,
        seed=6,
    )
    tuner = runs[k][0]
    if k == 1:
        assert_same_trials(runs["kt"][0], tuner)
    else:
        # With 4 at once the oracle suggests while trials run (it hallucinates their
        # scores, as in KerasTuner's distributed tuning), so the trials differ.
        assert len(tuner.oracle.trials) == 4
        assert all(t.status == "COMPLETED" for t in tuner.oracle.trials.values())
