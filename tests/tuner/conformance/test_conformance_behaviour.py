"""ParallelTuner vs KerasTuner on user code that customises the search or fails.

`run_trial` and `HyperModel.fit` overrides, the tuner's hooks, callbacks, executions per
trial, retries, failed and fatal trials, consecutive failures, and the errors a user gets:
each runs with KerasTuner's tuner and with ParallelTuner at parallel_trials 1 and 4
(executor="pack"), with the slots executor and with two worker processes
(executor="processes"); `make test` runs the backend's default executor, the others are
`slow` (kt_twins.py). Where worker processes differ from KerasTuner by nature (they run user
code in other processes), the case is an `xfail(strict=True)` saying why.
"""

import os
import re
import threading
import time
import warnings

import keras
import keras_tuner
import numpy as np
import pytest
from keras_tuner import errors
from kt_twins import (
    BACKEND,
    EVERY_EXECUTOR,
    PARALLEL,
    PROCESSES,
    SLOTS,
    SLOW_ON_JAX,
    WITH_PROCESSES,
    ByKind,
    CountingBuild,
    assert_same_trials,
    build,
    data,
    in_workers,
    make,
    search,
    slow_off_tensorflow,
    trials_view,
)

FIT = dict(epochs=2, validation_split=0.25, shuffle=False, verbose=0)


def _grid(*names_values):
    hp = keras_tuner.HyperParameters()
    for name, values in names_values:
        hp.Choice(name, values)
    return hp


def _grid_tuner(kind, tmp_path, name, hp, hypermodel=build, mixin=None, **kwargs):
    return make(
        kind,
        oracle=keras_tuner.oracles.GridSearchOracle,
        base_kt=keras_tuner.GridSearch,
        hyperparameters=hp,
        hypermodel=hypermodel,
        mixin=mixin,
        directory=str(tmp_path),
        project_name=f"{name}-{kind}",
        **kwargs,
    )


# Overrides ---------------------------------------------------------------------------------


class RunTrialOverride:
    """KerasTuner's documented pattern: build, then fit with a tuned batch size."""

    def run_trial(self, trial, *args, **kwargs):
        hp = trial.hyperparameters
        model = self.hypermodel.build(hp)
        return model.fit(*args, batch_size=hp.Choice("batch_size", [8, 16]), **kwargs)


class FitOverride(keras_tuner.HyperModel):
    def build(self, hp):
        return build(hp)

    def fit(self, hp, model, *args, **kwargs):
        return model.fit(*args, batch_size=hp.Choice("batch_size", [8, 16]), **kwargs)


class BlackBox:
    """`run_trial` as a black-box optimizer: no hypermodel, a float result."""

    def run_trial(self, trial, *args, **kwargs):
        x = trial.hyperparameters.Float("x", -2.0, 2.0)
        return x * x + 2 * x + 1


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    """`{kind: runs}`, and `{(kind, "declared"): runs}` with the space declared up front.

    The overrides declare `batch_size` (or `x`) inside the trial, so the oracle learns of
    it when the first trial ends: trials created before then get its default. Worker
    processes run trials at once, so which trials those are depends on timing; the
    processes executor is compared on the space declared to the oracle up front.
    """
    root = tmp_path_factory.mktemp("overrides")
    x, y = data()

    def run(key):
        kind, declared = key if isinstance(key, tuple) else (key, None)
        space = {}
        if declared:
            hp = keras_tuner.HyperParameters()
            hp.Choice("batch_size", [8, 16])
            hp.Float("x", -2.0, 2.0)
            space = dict(hyperparameters=hp)
        name = f"{kind}{declared or ''}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            common = dict(objective="val_loss", max_trials=2, seed=2, directory=str(root), **space)
            with_run_trial = make(kind, mixin=RunTrialOverride, project_name=f"r{name}", **common)
            search(with_run_trial, x, y, **FIT)
            with_fit = make(kind, hypermodel=FitOverride(), project_name=f"f{name}", **common)
            search(with_fit, x, y, **FIT)
            black_box = make(
                kind, hypermodel=None, mixin=BlackBox, max_trials=2, seed=2,
                directory=str(root), project_name=f"b{name}", **space,
            )  # fmt: skip
            search(black_box)
        messages = [str(w.message) for w in caught]
        return with_run_trial, with_fit, black_box, messages

    return ByKind(run)


def _override_runs(overrides, k):
    """(KerasTuner's runs, ParallelTuner's runs) to compare for `k`."""
    if k == PROCESSES:
        return overrides[("kt", "declared")], overrides[(k, "declared")]
    return overrides["kt"], overrides[k]


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_run_trial_override_is_honoured(overrides, k):
    reference, runs = _override_runs(overrides, k)
    assert_same_trials(reference[0], runs[0])
    assert all(t.status == "COMPLETED" for t in runs[0].oracle.trials.values())
    alone = [m for m in runs[3] if "overrides `run_trial`" in m and "one at a time" in m]
    assert bool(alone) == (k != PROCESSES)  # worker processes run them in parallel


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_hypermodel_fit_override_is_honoured(overrides, k):
    reference, runs = _override_runs(overrides, k)
    assert_same_trials(reference[1], runs[1])
    assert any("overrides `HyperModel.fit`" in m for m in runs[3]) == (k != PROCESSES)


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_black_box_run_trial_without_hypermodel(overrides, k):
    reference, runs = _override_runs(overrides, k)
    assert_same_trials(reference[2], runs[2])


def test_no_hypermodel_without_run_trial_override_raises_like_keras_tuner(tmp_path):
    with pytest.raises(ValueError) as theirs:
        keras_tuner.RandomSearch(hypermodel=None, directory=str(tmp_path))
    with pytest.raises(ValueError) as ours:
        make(1, hypermodel=None, directory=str(tmp_path))
    assert str(ours.value) == str(theirs.value)


class RecordingHooks:
    """Records the tuner's hooks: per trial, epoch ends, batch ends and the trial's end."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []
        self.lock = threading.Lock()

    def on_epoch_end(self, trial, model, epoch, logs=None):
        self.calls.append(("epoch", trial.trial_id, epoch, round(float(logs["val_loss"]), 4)))

    def on_batch_end(self, trial, model, batch, logs=None):
        self.calls.append(("batch", trial.trial_id, batch))

    def on_trial_end(self, trial):
        self.calls.append(("trial", trial.trial_id, trial.status))
        super().on_trial_end(trial)


class EpochCounter(keras.callbacks.Callback):
    ends: list = []

    def on_epoch_end(self, epoch, logs=None):
        EpochCounter.ends.append((epoch, self.model.count_params()))


@pytest.fixture(scope="module")
def hooks_and_executions(tmp_path_factory):
    """Tuner hooks and search callbacks, with two executions per trial."""
    root = tmp_path_factory.mktemp("hooks")
    x, y = data()

    def run(kind):
        EpochCounter.ends = []
        tuner = make(
            kind,
            mixin=RecordingHooks,
            hypermodel=CountingBuild(),
            objective="val_loss",
            max_trials=2,
            seed=8,
            executions_per_trial=2,
            directory=str(root),
            project_name=str(kind),
        )
        search(tuner, x, y, batch_size=16, callbacks=[EpochCounter()], **FIT)
        return tuner, sorted(EpochCounter.ends)

    return ByKind(run)


@pytest.mark.parametrize(
    "k",
    PARALLEL
    + [
        in_workers(
            "processes: each worker process has its own copy of the hypermodel, so a "
            "hypermodel that counts its builds (CountingBuild seeds each model from its call "
            "count) starts the executions from other weights than one KerasTuner process does"
        )
    ],
)
def test_executions_per_trial_are_averaged_like_keras_tuner(hooks_and_executions, k):
    reference, _ = hooks_and_executions["kt"]
    tuner, _ = hooks_and_executions[k]
    assert_same_trials(reference, tuner)
    x, y = data()
    # The checkpoint is the best epoch of all executions, as KerasTuner's SaveBestEpoch.
    np.testing.assert_allclose(
        tuner.get_best_models()[0].evaluate(x, y, verbose=0),
        reference.get_best_models()[0].evaluate(x, y, verbose=0),
        rtol=1e-4,
    )


@pytest.mark.parametrize(
    "k",
    PARALLEL
    + [
        in_workers(
            "processes: the tuner's hooks and the search's callbacks run in the worker "
            "processes, on their own copies of the tuner and callbacks; what they record "
            "(tuner.calls, EpochCounter.ends) is not in this process's objects"
        )
    ],
)
def test_tuner_hooks_and_callbacks_fire_like_keras_tuner(hooks_and_executions, k):
    reference, reference_ends = hooks_and_executions["kt"]
    tuner, ends = hooks_and_executions[k]
    assert sorted(tuner.calls) == sorted(reference.calls)
    assert ends == reference_ends  # each execution's own callback copy, each epoch
    assert len(ends) == 2 * 2 * 2
    assert any(call[0] == "batch" for call in tuner.calls)


# Failures ----------------------------------------------------------------------------------


class FailingBuild:
    """Raises `error` when hyperparameter `value` is in `bad`; counts its calls."""

    def __init__(self, bad, error=ValueError):
        self.bad = bad
        self.error = error
        self.calls = 0

    def __call__(self, hp):
        value = hp.Int("value", 1, 5)
        self.calls += 1
        if value in self.bad:
            raise self.error(f"wrong value {value}.")
        keras.utils.set_random_seed(value)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01 * value), "mse")
        return model


def _failing_tuner(kind, tmp_path, name, build_fn, random=False, **kwargs):
    """A tuner of `kind` over `build_fn` (a grid search, or a random one)."""
    return make(
        kind,
        oracle=keras_tuner.oracles.RandomSearchOracle
        if random
        else keras_tuner.oracles.GridSearchOracle,
        base_kt=keras_tuner.RandomSearch if random else keras_tuner.GridSearch,
        hypermodel=build_fn,
        objective="val_loss",
        directory=str(tmp_path),
        project_name=f"{name}-{kind}",
        **kwargs,
    )


def _failing_search(kind, tmp_path, name, build_fn, **kwargs):
    tuner = _failing_tuner(kind, tmp_path, name, build_fn, **kwargs)
    x, y = data()
    search(tuner, x, y, **dict(FIT, epochs=1))
    return tuner


class FailingBuild2(FailingBuild):
    """Value 2 raises ValueError (INVALID, retried), value 3 FailedTrialError (FAILED)."""

    def __call__(self, hp):
        if hp.Int("value", 1, 5) == 3:
            self.calls += 1
            raise errors.FailedTrialError("wrong value 3.")
        return super().__call__(hp)


@pytest.fixture(scope="module")
def retried(tmp_path_factory):
    root = tmp_path_factory.mktemp("retries")

    def run(kind):
        build_fn = FailingBuild2(bad=[2])
        return (
            _failing_search(kind, root, "retry", build_fn, max_retries_per_trial=2),
            build_fn.calls,
        )

    return ByKind(run)


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_retries_match_keras_tuner(retried, k):
    """INVALID trials run again up to `max_retries_per_trial`; FailedTrialError never."""
    reference, _ = retried["kt"]
    tuner, _ = retried[k]
    assert_same_trials(reference, tuner)
    by_value = {t.hyperparameters["value"]: t.status for t in tuner.oracle.trials.values()}
    assert by_value == {1: "COMPLETED", 2: "FAILED", 3: "FAILED", 4: "COMPLETED", 5: "COMPLETED"}
    assert dict(tuner.oracle.get_state()["run_times"]) == dict(
        reference.oracle.get_state()["run_times"]
    )


@pytest.mark.parametrize(
    "k",
    PARALLEL
    + [
        in_workers(
            "processes: the hypermodel builds in the worker processes, on their own copies "
            "of it, so this process's FailingBuild2.calls stays 0"
        )
    ],
)
def test_retries_build_as_often_as_keras_tuner(retried, k):
    tuner, calls = retried[k]
    # The slots executor also builds the hypermodel at a few points of the space before
    # its first program (probe builds), as many as its trials' paths say.
    whys = " ".join(path.get("why", "") for path in tuner.trial_paths().values())
    probes = {int(n) for n in re.findall(r"from (\d+) probe builds", whys)}
    assert len(probes) <= 1 and (k == SLOTS) == bool(probes), whys
    assert calls - sum(probes) == retried["kt"][1]


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_consecutive_failures_abort_like_keras_tuner(tmp_path, k):
    raised = {}
    for kind in ["kt", k]:
        with pytest.raises(RuntimeError) as info:
            _failing_search(
                kind,
                tmp_path,
                "consecutive",
                FailingBuild(bad=[2, 3, 4, 5], error=errors.FailedTrialError),
                max_consecutive_failed_trials=2,
            )
        raised[kind] = str(info.value).splitlines()[0]
    assert raised[k] == raised["kt"] == "Number of consecutive failures exceeded the limit of 2."


@pytest.mark.parametrize("k", PARALLEL)
def test_trials_begun_alongside_the_last_failure_are_ended_too(tmp_path, k):
    statuses = {}
    for kind in ["kt", k]:
        hypermodel = FailingBuild(bad=[], error=errors.FailedTrialError)
        tuner = _failing_tuner(
            kind,
            tmp_path,
            "begun",
            hypermodel,
            random=True,
            max_trials=5,
            max_consecutive_failed_trials=2,
        )
        hypermodel.bad = [1, 2, 3, 4, 5]  # every trial fails (the tuner's first build passed)
        with pytest.raises(RuntimeError, match="Number of consecutive failures"):
            search(tuner, *data(), **dict(FIT, epochs=1))
        statuses[kind] = [t.status for t in tuner.oracle.trials.values()]
    # KerasTuner ends its one trial before it stops; the trials begun alongside it (K at a
    # time) are ended too: none is left RUNNING for a reload to take as ongoing.
    assert statuses["kt"] == ["FAILED", "FAILED"]
    assert statuses[k][:2] == statuses["kt"]
    assert set(statuses[k]) == {"FAILED"}


class SlowEpochs(keras.callbacks.Callback):
    """Sleeps at each epoch's end: a trial that is still training while others fail."""

    def on_epoch_end(self, epoch, logs=None):
        time.sleep(3.0)


# Worker processes end their trials with the same chief code on every backend.
@slow_off_tensorflow
def test_a_workers_trial_running_when_failures_stop_the_search_ends_too(tmp_path):
    """Worker processes: value 1 trains (slowly) while values 2 and 3 fail at once in the
    other worker; the second failure stops the search, and the trial still training ends
    before `search` raises, as in-process trials do: a reload sees no trial running."""
    hypermodel = FailingBuild(bad=[2, 3, 4, 5], error=errors.FailedTrialError)
    tuner = _failing_tuner(
        PROCESSES, tmp_path, "workers", hypermodel, max_consecutive_failed_trials=2
    )
    with pytest.raises(RuntimeError, match="Number of consecutive failures"):
        search(tuner, *data(), **dict(FIT, epochs=1), callbacks=[SlowEpochs()])
    statuses = {t.trial_id: t.status for t in tuner.oracle.trials.values()}
    assert statuses["0000"] == "COMPLETED", statuses
    assert list(statuses.values()).count("FAILED") >= 2 and "RUNNING" not in statuses.values()
    reloaded = _failing_tuner(
        PROCESSES, tmp_path, "workers", hypermodel, overwrite=False, max_consecutive_failed_trials=2
    )
    assert {t.trial_id: t.status for t in reloaded.oracle.trials.values()} == statuses
    assert not reloaded.oracle.ongoing_trials


def _score_and_order_warnings(kind, tmp_path, **fit):
    """Each trial's score (by its hyperparameters) and the data-order warnings shown."""
    tuner = make(
        kind,
        objective="val_loss",
        max_trials=4,
        seed=3,
        directory=str(tmp_path),
        project_name=f"orders-{kind}-{fit.get('shuffle', True)}",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        search(tuner, *data(), epochs=2, validation_split=0.25, verbose=0, **fit)
    said = [w for w in caught if "one shuffled data order" in str(w.message)]
    scores = {
        tuple(sorted(t.hyperparameters.values.items())): t.score
        for t in tuner.oracle.trials.values()
    }
    return scores, said


# Both executors' orders on TensorFlow and torch; on JAX its default executor's (the pack
# executor's there with the slow tests).
# `shuffle=False` on TensorFlow and JAX with the slow tests: its scores are those of
# test_conformance_results.py's random search (the same search), which `make test` compares
# there; torch, which does not run that file, keeps it.
@pytest.mark.parametrize(
    "fit",
    [{}, pytest.param({"shuffle": False}, marks=[] if BACKEND == "torch" else pytest.mark.slow)],
    ids=["shuffled", "unshuffled"],
)
@pytest.mark.parametrize("k", PARALLEL if BACKEND == "jax" else EVERY_EXECUTOR)
def test_seeded_trials_each_train_on_their_own_shuffled_order(tmp_path, k, fit):
    """`build` seeds each model from its width, and `fit` shuffles by default (and splits
    off validation rows): plain KerasTuner shuffles each trial's data in the order its own
    `fit` draws. Trials trained together each get that order (their pack or program deals
    each member its own rows), so every trial scores as in KerasTuner, with nothing to
    warn about; with `shuffle=False` too. TensorFlow, JAX and torch (where every
    `DataLoader` iterator, validation's included, draws from torch's generator)."""
    reference, said = _score_and_order_warnings("kt", tmp_path, **fit)
    assert not said
    scores, said = _score_and_order_warnings(k, tmp_path, **fit)
    assert not said
    assert scores.keys() == reference.keys()
    for hp, score in reference.items():
        np.testing.assert_allclose(scores[hp], score, rtol=1e-4, err_msg=str((fit, hp)))


def test_seeded_trials_that_cannot_each_get_their_own_order_are_warned_about(tmp_path):
    """With `class_weight`, which a pack's dealt batches do not serve, seeded trials train
    together on one order: the search says so once, with the reason and the way out."""
    _, said = _score_and_order_warnings(4, tmp_path, class_weight={0: 1.0, 1: 2.0})
    assert len(said) == 1
    message = str(said[0].message)
    assert "`class_weight` is given" in message and "shuffle=False" in message


# Appending is the CSV logger's own code: on JAX with the slow tests.
@pytest.mark.parametrize(
    "append", [False, pytest.param(True, marks=SLOW_ON_JAX)], ids=["write", "append"]
)
@pytest.mark.parametrize("k", PARALLEL)
def test_a_csv_logger_leaves_whole_trials_like_keras_tuner(tmp_path, k, append):
    """Trials that train at once each write a `CSVLogger` file of their own, which takes the
    path when the trial ends: the path holds whole trials, as KerasTuner leaves it."""
    import csv

    tables, histories = {}, {}
    for kind in ["kt", k]:
        path = tmp_path / f"log-{kind}.csv"
        tuner = make(
            kind,
            objective="val_loss",
            max_trials=4,
            seed=2,
            directory=str(tmp_path),
            project_name=f"csv-{kind}-{append}",
        )
        logger = keras.callbacks.CSVLogger(str(path), append=append)
        search(tuner, *data(), **dict(FIT, epochs=3, callbacks=[logger]))
        with open(path, newline="") as f:
            tables[kind] = list(csv.reader(f))
        # The loss each trial reported to the oracle (its last epoch's).
        histories[kind] = {
            round(t.metrics.get_history("loss")[-1].value[0], 5)
            for t in tuner.oracle.trials.values()
        }
        assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]
    header, *rows = tables[k]
    assert header == tables["kt"][0]
    assert len(rows) == len(tables["kt"]) - 1 == (12 if append else 3)
    assert all(len(row) == len(header) for row in rows)
    epochs = [int(row[header.index("epoch")]) for row in rows]
    assert epochs == [0, 1, 2] * (4 if append else 1)
    losses = [round(float(row[header.index("loss")]), 5) for row in rows]
    # Each run of 3 rows is one trial's: its last loss is the one that trial reported.
    assert all(losses[i + 2] in histories[k] for i in range(0, len(losses), 3)), losses


@pytest.fixture(scope="module")
def fatal(tmp_path_factory):
    root = tmp_path_factory.mktemp("fatal")
    x, y = data()

    def run(kind):
        tuner = make(
            kind,
            oracle=keras_tuner.oracles.GridSearchOracle,
            base_kt=keras_tuner.GridSearch,
            hypermodel=FailingBuild(bad=[3], error=errors.FatalError),
            objective="val_loss",
            directory=str(root),
            project_name=f"fatal-{kind}",
        )
        with pytest.raises(errors.FatalError) as info:
            search(tuner, x, y, **dict(FIT, epochs=1))
        return tuner, str(info.value)

    return ByKind(run)


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_fatal_error_is_raised_again_like_keras_tuner(fatal, k):
    reference, expected = fatal["kt"]
    tuner, message = fatal[k]
    assert message == expected == "wrong value 3."
    trials = {t.hyperparameters["value"]: t for t in tuner.oracle.trials.values()}
    assert trials[3].status == "RUNNING"  # never ended: a resumed search runs it again
    if k == 1:
        assert_same_trials(reference, tuner)
    else:
        # The round's other trials trained alongside; they are recorded before the error.
        assert all(t.status == "COMPLETED" for v, t in trials.items() if v != 3)


def _nan_trial(hp):
    """The second trial's outputs are NaN from its first batch (a NaN bias), on every CPU."""
    bias = {"zero": 0.0, "nan": float("nan")}[hp.Choice("bias", ["zero", "nan"])]
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(4),
            keras.layers.Dense(1, bias_initializer=keras.initializers.Constant(bias)),
        ]
    )
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _overflowing(hp):
    """The second trial's weights overflow: its losses read inf or NaN by the CPU's kernels."""
    lr = hp.Choice("lr", [0.01, 1e9])
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(lr), "mse")
    return model


@pytest.fixture(scope="module")
def diverging(tmp_path_factory):
    """Two searches of two trials, one of them diverging, on each engine.

    Keys: `(case, kind)`, case "nan" or "overflow", kind "kt", the pack's `fuse` (False: graph
    engine, True: fused) or PROCESSES.
    """
    root = tmp_path_factory.mktemp("nan")
    x, y = data()
    cases = {
        "nan": (_nan_trial, ("bias", ["zero", "nan"])),
        "overflow": (_overflowing, ("lr", [0.01, 1e9])),
    }

    def run(key):
        case, kind = key
        hypermodel, grid = cases[case]
        kind, fuse = (kind, "auto") if kind in ("kt", PROCESSES) else (4, kind)
        tuner = _grid_tuner(
            kind, root, f"{case}-{key[1]}", _grid(grid), hypermodel=hypermodel,
            objective="val_loss", fuse=fuse,
        )  # fmt: skip
        search(tuner, x, y, **FIT)
        return tuner

    return ByKind(run)


@pytest.mark.parametrize(
    "fuse",
    [False, True, pytest.param(PROCESSES, marks=pytest.mark.slow)],
    ids=["graph", "fused", "processes"],
)
def test_a_nan_trial_is_scored_like_keras_tuner(diverging, fuse):
    """A NaN loss in every epoch: KerasTuner fails the trial (invalid, retried), as the pack."""
    assert_same_trials(diverging["nan", "kt"], diverging["nan", fuse])
    statuses = {
        t.hyperparameters["bias"]: t.status for t in diverging["nan", fuse].oracle.trials.values()
    }
    assert statuses["zero"] == "COMPLETED" and statuses["nan"] != "COMPLETED", statuses


@pytest.mark.parametrize("fuse", [False, True], ids=["graph", "fused"])
def test_an_overflowing_trial_never_wins_on_any_cpu(diverging, fuse):
    """Past an overflow, inf or NaN is the CPU's kernels' choice, for plain Keras as for a pack.

    oneDNN's matmul sums `+inf` and `-inf` partial products to `inf` where Eigen's (CPUs
    without AVX-512, `TF_ENABLE_ONEDNN_OPTS=0`) gives NaN, so KerasTuner itself scores the
    diverged trial `inf` (COMPLETED) on one machine and NaN (invalid, so FAILED once its
    retries are spent) on another. What holds everywhere: the finite trial is KerasTuner's to
    the last figure, and the diverged one is either failed or scored worse than any finite
    trial, in KerasTuner and in the pack alike.
    """
    reference, tuner = diverging["overflow", "kt"], diverging["overflow", fuse]
    ref, got = trials_view(reference), trials_view(tuner)
    assert sorted(got) == sorted(ref)
    for trial_id, expected in ref.items():
        actual = got[trial_id]
        if expected["values"]["lr"] == 0.01:
            assert actual["status"] == expected["status"] == "COMPLETED"
            np.testing.assert_allclose(actual["score"], expected["score"], rtol=1e-4)
            continue
        for trial in (expected, actual):
            assert trial["status"] in ("COMPLETED", "FAILED"), trial
            assert trial["status"] == "FAILED" or not np.isfinite(trial["score"]), trial
    best = tuner.get_best_hyperparameters()[0].values
    assert best == reference.get_best_hyperparameters()[0].values == {"lr": 0.01}


def not_a_model(hp):
    hp.Int("value", 1, 3)
    return "model"


class NotCopyable(keras.callbacks.Callback):
    def __deepcopy__(self, memo):
        raise TypeError("no copies")


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_user_errors_match_keras_tuner(tmp_path, k):
    x, y = data()
    cases = [
        (
            dict(hypermodel=not_a_model, objective="val_loss", max_trials=2),
            dict(epochs=1),
        ),
        (
            dict(objective="val_loss", max_trials=2),
            dict(epochs=1, callbacks=[NotCopyable()]),
        ),
    ]
    for index, (make_kwargs, fit_kwargs) in enumerate(cases):
        got = {}
        for kind in ["kt", k]:
            tuner = make(
                kind, directory=str(tmp_path), project_name=f"e{index}-{kind}", **make_kwargs
            )
            with pytest.raises(errors.FatalError) as info:
                search(tuner, x, y, verbose=0, **fit_kwargs)
            got[kind] = (type(info.value), str(info.value).split(" at 0x")[0])
        assert got[k] == got["kt"]
    with pytest.raises(ValueError) as theirs:
        keras_tuner.Tuner(oracle="random", hypermodel=build, directory=str(tmp_path))
    with pytest.raises(ValueError) as ours:
        make(k, oracle=lambda: "random", directory=str(tmp_path))
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError) as theirs:
        make("kt", objective="val_unknown_thing", directory=str(tmp_path))
    with pytest.raises(ValueError) as ours:
        make(k, objective="val_unknown_thing", directory=str(tmp_path))
    assert str(ours.value) == str(theirs.value)


class FrozenSequential(keras.Sequential):
    """A model whose own `train_step` never updates it (a pack must not bypass it)."""

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            # JAX's stateless step: `(state, data)` in, `(logs, state)` out; the step
            # is the test step's, with the optimizer's variables handed back unchanged.
            (trainable, non_trainable, optimizer_variables, metrics), data = args
            logs, state = self.test_step((trainable, non_trainable, metrics), data)
            trainable, non_trainable, metrics = state
            return logs, (trainable, non_trainable, optimizer_variables, metrics)
        x, y = args[0]
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        return self.compute_metrics(x, y, y_pred) | {"loss": loss}


def _frozen(hp):
    units = hp.Choice("units", [2, 4])
    keras.utils.set_random_seed(units)
    model = FrozenSequential([keras.Input((6,)), keras.layers.Dense(units), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


@pytest.mark.parametrize("k", WITH_PROCESSES)
def test_a_model_with_its_own_train_step_trains_as_in_keras_tuner(tmp_path, k):
    tuners = {}
    for kind in ["kt", k]:
        tuners[kind] = make(
            kind, hypermodel=_frozen, objective="val_loss", max_trials=2, seed=1,
            directory=str(tmp_path), project_name=str(kind),
        )  # fmt: skip
        search(tuners[kind], *data(), **FIT)
    assert_same_trials(tuners["kt"], tuners[k])
    for trial in tuners[k].oracle.trials.values():
        losses = trial.metrics.get_history("loss")
        assert losses and trial.status == "COMPLETED"


def squared_error(y_true, y_pred):
    """A plain Python loss, not registered with Keras's serialization."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


class LargestError(keras.metrics.Metric):
    """A `Metric` subclass, not registered with Keras's serialization."""

    def __init__(self, name="largest_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.largest = self.add_variable((), initializer="zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        error = keras.ops.max(keras.ops.abs(y_true - y_pred))
        self.largest.assign(keras.ops.maximum(self.largest, error))

    def result(self):
        # A value, not the variable: Keras reads the epoch's logs after validation ran.
        return keras.ops.multiply(self.largest, 1.0)


def _unregistered(hp):
    units = hp.Choice("units", [2, 4])
    keras.utils.set_random_seed(units)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(units), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), squared_error, metrics=[LargestError()])
    return model


@pytest.mark.parametrize("fuse", [False, True], ids=["graph", "fused"])
def test_unregistered_loss_and_metric_train_as_in_keras_tuner(tmp_path, fuse):
    # They failed with "Could not locate function 'squared_error'" before any trial ran.
    tuners = {}
    for kind in ["kt", 2]:
        tuners[kind] = make(
            kind, hypermodel=_unregistered, objective="val_loss", max_trials=2, seed=1,
            directory=str(tmp_path), project_name=str(kind), fuse=fuse,
        )  # fmt: skip
        search(tuners[kind], *data(), **FIT)
    assert_same_trials(tuners["kt"], tuners[2])
    for trial in tuners[2].oracle.trials.values():
        assert trial.status == "COMPLETED"
        assert trial.metrics.get_history("val_largest_error")
