"""ParallelTuner says which path each trial took, and why (`trial_paths`, `results_summary`)."""

import json
import logging
import os

import keras
import keras_tuner
import pytest
import tuner_helpers as th

import keras_gpushare as kg

MODES = ["narrow", "wide", "custom_layer", "own_step"]


class Twice(keras.layers.Layer):
    """A layer with no fused form: a model with it trains on the graph engine."""

    def call(self, x):
        return 2.0 * x


class OwnStep(keras.Sequential):
    """A model that trains itself: a pack would not call its `train_step`."""

    def train_step(self, *args):
        return super().train_step(*args)


def build_by_mode(hp) -> keras.Model:
    """Four architectures: two that fuse, one that cannot fuse, one that trains itself."""
    mode = hp.Choice("mode", MODES)
    keras.utils.set_random_seed(MODES.index(mode))
    layers = [keras.Input((6,)), keras.layers.Dense(8 if mode == "wide" else 4, activation="relu")]
    if mode == "custom_layer":
        layers.append(Twice(name="twice"))
    layers.append(keras.layers.Dense(1, activation="sigmoid"))
    model = (OwnStep if mode == "own_step" else keras.Sequential)(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="binary_crossentropy")
    return model


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _tuner(root, name, build=build_by_mode, tuner_class=kg.tuner.ParallelTuner, **kwargs):
    return tuner_class(
        build,
        objective="val_loss",
        directory=str(root),
        project_name=name,
        **kwargs,
    )


def _search(tuner):
    x, y = th.data()
    tuner.search(x, y, epochs=1, validation_split=0.25, verbose=0, shuffle=False, batch_size=16)


@pytest.fixture(scope="module")
def by_mode(tmp_path_factory):
    """One round of the four modes (RandomSearch draws each once); `(tuner, paths, logs)`."""
    root = tmp_path_factory.mktemp("paths")
    records = _Records()
    logger = logging.getLogger("keras_gpushare.tuner")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        tuner = _tuner(root, "modes", max_trials=4, parallel_trials=4, seed=1)
        _search(tuner)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    paths = {
        tuner.oracle.get_trial(trial_id).hyperparameters["mode"]: (trial_id, path)
        for trial_id, path in tuner.trial_paths().items()
    }
    return tuner, paths, records.messages


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the graph engine runs on TensorFlow only"
)
def test_a_trial_packed_alone_says_why_naming_no_argument_not_passed(tmp_path):
    """One trial in its round, `fuse` left at "auto": a pack of one on the graph engine."""
    tuner = _tuner(tmp_path, "alone", build=th.build_mlp, max_trials=1, executor="pack", seed=1)
    _search(tuner)
    assert tuner.trial_paths() == {
        "0": {
            "path": "graph",
            "pack": "trial 0 (batch size 16)",
            "why": "it is the pack's only member, and a pack of one trains on the graph engine",
        }
    }


def test_trials_that_fuse_record_their_pack_and_group(by_mode):
    tuner, paths, _ = by_mode
    assert sorted(paths) == sorted(MODES)
    (narrow_id, narrow), (wide_id, wide) = paths["narrow"], paths["wide"]
    custom_id = paths["custom_layer"][0]
    assert narrow["path"] == wide["path"] == "fused"
    assert narrow["group"] == f"fused group 0 with trial {wide_id}"
    assert wide["group"] == f"fused group 0 with trial {narrow_id}"
    # One pack of the three trials a pack can train, at the search's batch size.
    packed = ", ".join(sorted([narrow_id, wide_id, custom_id]))
    assert narrow["pack"] == wide["pack"] == f"trials {packed} (batch size 16)"
    assert "FLOPs are padding" in narrow["why"]  # the narrow trial is padded to 8 units


def test_a_trial_that_cannot_fuse_records_the_planners_reason(by_mode):
    tuner, paths, _ = by_mode
    trial_id, path = paths["custom_layer"]
    assert path["path"] == "graph"
    assert "group" not in path
    # The reason is the planner's own, as a pack of the same models reports it.
    hp = tuner.oracle.get_trial(trial_id).hyperparameters
    models = [build_by_mode(hp)]
    for mode in ("narrow", "wide"):
        models.append(build_by_mode(tuner.oracle.get_trial(paths[mode][0]).hyperparameters))
    report = kg.ModelPack(models).fusion_report
    assert path["why"].startswith("layer `twice` (Twice): layer type `Twice` has no fused form")
    assert path["why"] in report


def test_a_model_that_trains_itself_runs_alone_and_says_why(by_mode):
    _, paths, _ = by_mode
    _, path = paths["own_step"]
    assert path == {"path": "alone", "why": "its model overrides `train_step`"}


def test_paths_are_logged_and_kept_in_the_tuner_file(by_mode):
    tuner, paths, messages = by_mode
    for trial_id, path in paths.values():
        assert any(m.startswith(f"Trial {trial_id}: {path['path']}") for m in messages)
    with open(os.path.join(tuner.project_dir, "tuner0.json")) as f:
        assert json.load(f)["trial_paths"] == tuner.trial_paths()


def test_results_summary_prints_each_trials_path(by_mode, capsys):
    tuner, _, _ = by_mode
    tuner.results_summary(num_trials=4)
    out = capsys.readouterr().out
    blocks = out.split("\n\n")[1:]
    assert len(blocks) == 4
    for block in blocks:
        path = tuner.trial_paths()[block.split()[1]]  # "Trial 2 summary ..."
        (line,) = [line for line in block.splitlines() if line.startswith("Path: ")]
        assert line.startswith(f"Path: {path['path']}") and line.endswith(path["why"])
    assert "\nPath: alone: its model overrides `train_step`\n" in out
    assert "\nPath: graph (pack of trials " in out
    assert "\nPath: fused (pack of trials " in out


def test_a_resumed_tuner_reports_the_paths_of_earlier_trials(by_mode, capsys):
    tuner, _, _ = by_mode
    resumed = _tuner(tuner.directory, "modes", max_trials=4, parallel_trials=4, seed=1)
    assert resumed.trial_paths() == tuner.trial_paths()
    _search(resumed)  # nothing left to run; the state written again keeps the paths
    again = _tuner(tuner.directory, "modes", max_trials=4, parallel_trials=4, seed=1)
    assert again.trial_paths() == tuner.trial_paths()
    capsys.readouterr()
    again.results_summary(num_trials=4)
    assert capsys.readouterr().out.count("\nPath: ") == 4


def test_a_pack_that_raised_is_split_and_each_trial_says_so(tmp_path):
    hp = keras_tuner.HyperParameters()
    hp.Choice("mode", ["ok", "bad", "ok2"])
    oracle = keras_tuner.oracles.GridSearchOracle(objective="val_loss", hyperparameters=hp)
    tuner = kg.tuner.ParallelTuner(
        th.build_wrong_input, oracle=oracle, directory=str(tmp_path), project_name="split"
    )
    _search(tuner)
    paths = {
        tuner.oracle.get_trial(trial_id).hyperparameters["mode"]: path
        for trial_id, path in tuner.trial_paths().items()
    }
    bad = paths["bad"]
    assert bad["path"] == "alone"
    assert bad["why"].startswith("its pack raised ")
    assert bad["split"].startswith("the pack of trials ")
    assert bad["split"].endswith("each of its trials was then packed alone to find which")
    split = [path for path in paths.values() if "split" in path]
    assert len(split) >= 2  # the failed pack held "bad" and at least one other trial
    for path in split:
        assert path["split"] == bad["split"]
        if path is not bad:
            assert path["path"] == "graph" and path["pack"].startswith("trial ")


class RunTrialTuner(kg.tuner.ParallelTuner):
    def run_trial(self, trial, *args, **kwargs):
        return super().run_trial(trial, *args, **kwargs)


def test_a_tuner_that_runs_one_trial_at_a_time_says_why(tmp_path):
    tuner = _tuner(
        tmp_path, "one", tuner_class=RunTrialTuner, build=th.build_mlp, max_trials=2, seed=1
    )
    with pytest.warns(UserWarning, match="runs each trial alone"):
        _search(tuner)
    paths = tuner.trial_paths()
    assert sorted(paths) == sorted(tuner.oracle.trials)
    for path in paths.values():
        assert path == {
            "path": "alone",
            "why": "this tuner runs every trial alone, one at a time, as KerasTuner does: "
            "RunTrialTuner overrides `run_trial`",
        }


def test_the_chief_of_worker_processes_records_their_trials(tmp_path, capsys):
    kwargs = dict(build=th.build_mlp, executor="processes", max_trials=2, parallel_trials=2, seed=1)
    tuner = _tuner(tmp_path, "processes", **kwargs)
    _search(tuner)
    # Each worker reported its trials' paths, naming itself.
    expected = tuner.trial_paths()
    assert sorted(expected) == sorted(tuner.oracle.trials) == ["0", "1"]
    for path in expected.values():
        assert path["worker"] in ("worker0", "worker1")
        why = f"worker process {path['worker']} ran it alone with KerasTuner's `run_trial`"
        assert path == {"path": "worker", "why": why, "worker": path["worker"]}
    assert _tuner(tmp_path, "processes", **kwargs).trial_paths() == expected
    capsys.readouterr()
    tuner.results_summary()
    printed = capsys.readouterr().out
    assert sum(printed.count(f"\nPath: worker: {p['why']}\n") for p in expected.values()) == 2
