"""Programs planned from the search space (`tuner/_space_plan.py`).

Probe builds put back every generator and layer-name counter they touch; their points hold
each number's extremes and every other choice; a search of 16 trials over depth, widths,
activations and optimizer families compiles one program and each trial still trains as
KerasTuner's own tuner trains it; and in a space where some trials cannot fuse, the others
keep a program while those train alone, each saying why (issue 60, item 6). Runs on
TensorFlow and JAX.
"""

import logging
import os
import random
import sys

import keras
import keras_tuner
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))

from kt_twins import assert_same_trials  # noqa: E402

import keras_gpushare as kg  # noqa: E402
from keras_gpushare.tuner import _space_plan  # noqa: E402


def _slow_on_tensorflow(test):
    """`make test-all` only on TensorFlow (its pack executor is the default there)."""
    return pytest.mark.slow(test) if keras.backend.backend() == "tensorflow" else test


FIT = dict(epochs=1, validation_split=0.25, shuffle=False, verbose=0)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, :2].sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def _weights_and_names():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dropout(0.5)])
    draws = (random.random(), np.random.random(), keras.random.uniform((2,)))
    return [layer.name for layer in model.layers], model.get_weights(), draws


def _untouched_twice():
    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    expected = _weights_and_names()
    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    with _space_plan.untouched():
        keras.utils.set_random_seed(7)
        _weights_and_names()
        keras.layers.Dense(2)
    return expected, _weights_and_names()


def test_probes_leave_every_generator_and_layer_name_as_they_were():
    (names, weights, draws), (names_after, weights_after, draws_after) = _untouched_twice()
    assert names_after == names
    for a, b in zip(weights, weights_after):
        np.testing.assert_array_equal(a, b)
    assert draws_after[:2] == draws[:2]
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(draws_after[2]), keras.ops.convert_to_numpy(draws[2])
    )


@pytest.mark.skipif(keras.backend.backend() == "tensorflow", reason="TensorFlow is its backend")
def test_probes_need_no_tensorflow_where_there_is_none(monkeypatch):
    # The GPU machine has JAX and no TensorFlow: `import tensorflow` fails there, as it does
    # with None in `sys.modules` (benchmarks/gpu_table.py runs its searches that way).
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    (names, weights, draws), (names_after, weights_after, draws_after) = _untouched_twice()
    assert names_after == names
    assert draws_after[:2] == draws[:2]


def _space():
    hp = keras_tuner.HyperParameters()
    hp.Int("layers", 1, 3)
    hp.Int("units_0", 16, 128, step=16)
    hp.Choice("activation", ["relu", "tanh", "gelu"])
    hp.Choice("width", [8, 32, 16])
    hp.Boolean("dropout")
    hp.Float("lr", 1e-4, 1e-2, sampling="log")
    return hp


def test_points_hold_each_numbers_extremes_and_every_other_choice():
    space = _space()
    assert _space_plan.distinct_points(space) == 3
    points = _space_plan.points(space, 3)
    assert {p["layers"] for p in points} == {1, 3}
    assert {p["units_0"] for p in points} == {16, 128}
    assert {p["width"] for p in points} == {8, 32}
    assert {p["activation"] for p in points} == {"relu", "tanh", "gelu"}
    assert {p["dropout"] for p in points} == {True, False}
    assert all("lr" not in p for p in points)


def test_probes_learn_what_builds_declare_and_skip_a_build_that_raises():
    space = keras_tuner.HyperParameters()
    space.Int("layers", 1, 3)
    built = []

    def build(hp):
        layers = [keras.Input((4,))]
        for i in range(hp.Int("layers", 1, 3)):
            layers.append(keras.layers.Dense(hp.Int(f"units_{i}", 2, 8, step=2)))
        if hp.get("layers") == 1 and built:
            raise ValueError("no shallow model after the first")
        built.append([layer.units for layer in layers[1:]])
        model = keras.Sequential([*layers, keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        return model

    plan = _space_plan.probe(space, build, slots=2)
    # units_1 and units_2 were declared by the deepest build, then built at their maximum.
    assert [8, 8, 8] in built
    assert {"units_1", "units_2"} <= {hp.name for hp in space.space}
    assert any("a probe build raised ValueError" in line for line in plan.skipped)
    assert len(plan.models) == 2 and plan.builds >= 4


def build_16(hp) -> keras.Model:
    """The space of issue 58: depth 1-3, units 16-128 step 16, relu or tanh, Adam or SGD
    with momentum, a log learning rate."""
    model = keras.Sequential([keras.Input((6,))])
    for i in range(hp.Int("layers", 1, 3)):
        units = hp.Int(f"units_{i}", 16, 128, step=16)
        activation = hp.Choice("activation", ["relu", "tanh"])
        model.add(keras.layers.Dense(units, activation=activation))
    model.add(keras.layers.Dense(1, activation="sigmoid"))
    lr = hp.Float("lr", 1e-4, 1e-2, sampling="log")
    if hp.Choice("optimizer", ["adam", "sgd"]) == "adam":
        optimizer = keras.optimizers.Adam(lr)
    else:
        optimizer = keras.optimizers.SGD(lr, momentum=0.9)
    model.compile(optimizer, "binary_crossentropy", metrics=["accuracy"])
    return model


def _search(tmp_path, kind, hypermodel, max_trials, parallel_trials=4, seed=1):
    kwargs = dict(
        hypermodel=hypermodel,
        objective="val_loss",
        max_trials=max_trials,
        seed=seed,
        directory=str(tmp_path),
        project_name=kind,
    )
    # The builds draw their weights from the generators as they are (no seed of their
    # own): each search starts from the same state, and probes must not move it.
    keras.utils.set_random_seed(0)
    if kind == "kt":
        tuner = keras_tuner.RandomSearch(**kwargs)
    else:
        tuner = kg.tuner.ParallelTuner(parallel_trials=parallel_trials, executor=kind, **kwargs)
    tuner.search(*_data(), **FIT)
    return tuner


# Slots are the default executor on JAX, where `make test` runs this search; on TensorFlow
# the executor's seam test (test_slot_executor.py) plans a program in `make test`.
@_slow_on_tensorflow
def test_sixteen_trials_of_the_space_share_one_planned_program(tmp_path, caplog):
    reference = _search(tmp_path, "kt", build_16, 16)
    with caplog.at_level(logging.INFO, logger="keras_gpushare.tuner"):
        tuner = _search(tmp_path, "slots", build_16, 16)
    assert_same_trials(reference, tuner)
    paths = tuner.trial_paths()
    assert len({p["program"] for p in paths.values()}) <= 2, paths
    assert {p["path"] for p in paths.values()} == {"slot"}
    assert all("planned from the space: 1 template from" in p["why"] for p in paths.values())
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Search:"))
    assert "1 program compiled (planned from" in summary, summary
    assert "probe builds of the space" in summary and "of the FLOPs" in summary, summary
    # Probes never reach the oracle or the project folder.
    assert len(tuner.oracle.trials) == 16
    assert sorted(os.listdir(tmp_path / "slots")) == sorted(os.listdir(tmp_path / "kt"))


class Scale(keras.layers.Layer):
    """A user's layer with a weight: no fused form."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


def build_kinds(hp) -> keras.Model:
    kind = hp.Choice("kind", ["custom", "lambda", "plain"])
    units = hp.Choice("units", [2, 4])
    keras.utils.set_random_seed(units)
    extra = {
        "custom": [Scale(name="scale")],
        "lambda": [keras.layers.Lambda(lambda x: x * 2.0, name="double")],
        "plain": [],
    }[kind]
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(units), *extra, keras.layers.Dense(1, "sigmoid")]
    )
    model.compile(keras.optimizers.SGD(0.1), "binary_crossentropy", metrics=["accuracy"])
    return model


def test_trials_that_can_share_a_program_keep_one_beside_trials_that_cannot_fuse(tmp_path):
    """Issue 60, item 6: plain trials train in a program; on JAX, where every member of a
    program must fuse, the trials with a user's layer or a `Lambda` train alone, each
    naming its own layer."""
    reference = _search(tmp_path, "kt", build_kinds, 6, seed=3)
    tuner = _search(tmp_path, "slots", build_kinds, 6, parallel_trials=3, seed=3)
    assert_same_trials(reference, tuner)
    paths = tuner.trial_paths()
    kinds = {i: t.hyperparameters.get("kind") for i, t in tuner.oracle.trials.items()}
    assert set(kinds.values()) == {"custom", "lambda", "plain"}, kinds
    for trial_id, kind in kinds.items():
        path = paths[trial_id]
        if kind == "plain" or keras.backend.backend() == "tensorflow":
            assert path["path"] == "slot", (kind, path)
            continue
        assert path["path"] == "alone", (kind, path)
        layer = {"custom": "`scale` (Scale)", "lambda": "`double` (Lambda)"}[kind]
        assert layer in path["why"], path
        other = {"custom": "`double`", "lambda": "`scale`"}[kind]
        assert other not in path["why"], path


def test_a_space_where_no_probe_fuses_has_no_plan():
    space = keras_tuner.HyperParameters()
    space.Choice("kind", ["custom", "lambda"])
    assert _space_plan.probe(space, build_kinds, slots=2) is None
