"""`executor="slots"`: trials streamed through the slots of packs kept for the search.

A trial loaded into a slot that another trial used before trains as KerasTuner's own tuner
trains it (same scores, metrics and best steps, checked against `keras_tuner.RandomSearch`
on the same code), the slots are refilled without a new program where the trial fits
(`trial_paths` say which program and slot), a program's searched layers share one
capacity, and a trial deeper than every slot opens a program of its own. Runs on TensorFlow
and JAX.
"""

import os
import re
import sys

import keras
import keras_tuner
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))

from kt_twins import assert_same_trials  # noqa: E402

import keras_gpushare as kg  # noqa: E402

FIT = dict(epochs=2, validation_split=0.25, shuffle=False, verbose=0)


# How trials are planned into programs and slots is the same code on every backend: on
# TensorFlow, where the default executor is "pack", `make test` runs one search that
# streams trials through refilled slots against KerasTuner, and the planning tests below run
# with the slow tests (`make test-all`); on JAX, where slots are the default, in `make test`.
def planning(test):
    """`test`, marked `slow` on TensorFlow."""
    return pytest.mark.slow(test) if keras.backend.backend() == "tensorflow" else test


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, :2].sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def build(hp, depth=1) -> keras.Model:
    """Widths, activations, dropout rates and learning rates a slot holds as data; depth
    (`layers`) a program's structure."""
    units = hp.Choice("units", [2, 4, 8])
    activation = hp.Choice("activation", ["relu", "tanh"])
    keras.utils.set_random_seed(units)
    layers = [keras.Input((6,))]
    for _ in range(hp.Int("layers", 1, depth)):
        layers += [keras.layers.Dense(units, activation=activation), keras.layers.Dropout(0.0)]
    model = keras.Sequential([*layers, keras.layers.Dense(1, activation="sigmoid")])
    lr = hp.Float("lr", 1e-3, 1e-1, sampling="log")
    model.compile(keras.optimizers.SGD(lr), "binary_crossentropy", metrics=["accuracy"])
    return model


def _search(tmp_path, kind, max_trials=9, hypermodel=build, fit=FIT, seed=5):
    kwargs = dict(
        hypermodel=hypermodel,
        objective="val_loss",
        max_trials=max_trials,
        seed=seed,
        directory=str(tmp_path),
        project_name=kind,
    )
    if kind == "kt":
        tuner = keras_tuner.RandomSearch(**kwargs)
    else:
        tuner = kg.tuner.ParallelTuner(parallel_trials=3, executor=kind, **kwargs)
    tuner.search(*_data(), **fit)
    return tuner


def test_streamed_trials_match_keras_tuner_and_refill_slots(tmp_path):
    reference = _search(tmp_path, "kt")
    tuner = _search(tmp_path, "slots")
    assert_same_trials(reference, tuner)
    paths = tuner.trial_paths()
    assert {p["path"] for p in paths.values()} == {"slot"}
    loaded = [p for p in paths.values() if p["why"].startswith("loaded into slot")]
    assert loaded, paths
    # Nine trials through three slots: most of them refill a slot of a program already built.
    assert len({p["program"] for p in paths.values()}) < len(paths) // 2


def _families(hp) -> keras.Model:
    """The optimizer's family and hyperparameters chosen per trial: data of a slot too.

    Every hyperparameter is declared in every build: one first declared by a build is
    unknown to the trials made at the same time (as with KerasTuner's own workers)."""
    model = build(hp)
    lr = hp.get("lr")
    beta_1, momentum = hp.Float("beta_1", 0.8, 0.95), hp.Float("momentum", 0.5, 0.9)
    if hp.Choice("optimizer", ["adam", "sgd"]) == "adam":
        optimizer = keras.optimizers.Adam(lr, beta_1=beta_1)
    else:
        optimizer = keras.optimizers.SGD(lr, momentum=momentum)
    model.compile(optimizer, "binary_crossentropy", metrics=["accuracy"])
    return model


@planning
def test_trials_of_other_optimizer_families_share_the_slots(tmp_path):
    reference = _search(tmp_path, "kt", hypermodel=_families, seed=2)
    tuner = _search(tmp_path, "slots", hypermodel=_families, seed=2)
    assert_same_trials(reference, tuner)
    paths = tuner.trial_paths()
    # One program for the search (its first trials held both families), and a slot that
    # held a trial of one family took a trial of the other.
    assert {p["program"] for p in paths.values()} == {"0"}, paths
    family = {i: t.hyperparameters.get("optimizer") for i, t in tuner.oracle.trials.items()}
    by_slot: dict = {}
    for trial_id in sorted(paths, key=int):
        by_slot.setdefault(paths[trial_id]["slot"], []).append(family[trial_id])
    assert any(a != b for held in by_slot.values() for a, b in zip(held, held[1:])), by_slot


def _deeper(hp) -> keras.Model:
    return build(hp, depth=2)


def _deeper_at_high_rates(hp) -> keras.Model:
    """Three hidden layers where the learning rate is above 0.01, else one: a depth that no
    probe of the space builds (probes leave rates at their default, 1e-3), so the program
    planned from the space does not take those trials."""
    lr = hp.Float("lr", 1e-3, 1e-1, sampling="log")
    units = hp.Choice("units", [2, 4, 8])
    keras.utils.set_random_seed(units)
    hidden = [keras.layers.Dense(units, activation="relu") for _ in range(3 if lr > 0.01 else 1)]
    model = keras.Sequential([keras.Input((6,)), *hidden, keras.layers.Dense(1, "sigmoid")])
    model.compile(keras.optimizers.SGD(lr), "binary_crossentropy", metrics=["accuracy"])
    return model


@planning
def test_a_trial_that_fits_no_slot_opens_a_program_and_still_matches(tmp_path):
    reference = _search(tmp_path, "kt", max_trials=6, hypermodel=_deeper_at_high_rates, seed=1)
    tuner = _search(tmp_path, "slots", max_trials=6, hypermodel=_deeper_at_high_rates, seed=1)
    assert_same_trials(reference, tuner)
    paths = tuner.trial_paths()
    rates = {i: t.hyperparameters.get("lr") for i, t in tuner.oracle.trials.items()}
    deeper = [i for i in paths if rates[i] > 0.01]
    assert deeper and len(deeper) < len(paths), (rates, paths)
    assert all(paths[i]["program"] != "0" for i in deeper), paths
    # The path says why the open program did not take the trial.
    opener = next(i for i in deeper if paths[i]["why"].startswith("opened program"))
    assert "(program 0" in paths[opener]["why"], paths[opener]
    assert any(
        text in paths[opener]["why"] for text in ("had no free slot", "free slots do not take it")
    ), paths[opener]


class Doubling(keras.layers.Layer):
    def call(self, x):
        return x * 2


def _with_custom_layer(hp):
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(hp.Choice("units", [2, 4])), Doubling()]
        + [keras.layers.Dense(1, activation="sigmoid")]
    )
    model.compile("sgd", "binary_crossentropy")
    return model


@pytest.mark.skipif(keras.backend.backend() == "tensorflow", reason="the graph engine takes it")
def test_a_trial_that_cannot_fuse_trains_alone_and_its_path_names_the_layer(tmp_path):
    tuner = _search(tmp_path, "slots", max_trials=2, hypermodel=_with_custom_layer)
    assert {t.status for t in tuner.oracle.trials.values()} == {"COMPLETED"}
    for trial_id, path in tuner.trial_paths().items():
        assert path["path"] == "alone", path
        assert path["why"].startswith("it trains alone, with KerasTuner's code"), path
        # Each trial names its own layer (`doubling`, `doubling_1`).
        assert re.search(r"cannot fuse: layer `doubling(_\d)?` \(Doubling\)", path["why"]), path
        assert f"trial {trial_id}" in path["why"], path


@planning
def test_searched_layers_share_one_capacity(tmp_path):
    """A program's searched Dense layers hold the widest width and every activation of
    any of them: a trial whose second layer is wider, or uses another activation, than the
    second layers of the trials the program was opened with loads into a slot (with seed
    5, trial 3 has a second layer of 4 relu units; the first three trials' second layers
    were 2 relu units) and trains as KerasTuner's own tuner trains it."""
    reference = _search(tmp_path, "kt", max_trials=6, hypermodel=_deeper)
    tuner = _search(tmp_path, "slots", max_trials=6, hypermodel=_deeper)
    assert_same_trials(reference, tuner)
    paths = tuner.trial_paths()
    assert {p["program"] for p in paths.values()} == {"0"}, paths
    opened = [t for t in tuner.oracle.trials.values() if "opened" in paths[t.trial_id]["why"]]
    second = {
        (t.hyperparameters.get("units"), t.hyperparameters.get("activation"))
        for t in opened
        if t.hyperparameters.get("layers") == 2
    }
    later = [
        t
        for t in tuner.oracle.trials.values()
        if t not in opened
        and t.hyperparameters.get("layers") == 2
        and (t.hyperparameters.get("units"), t.hyperparameters.get("activation")) not in second
        and t.hyperparameters.get("units") > min(u for u, _ in second)
    ]
    assert later, (second, paths)


def test_results_summary_says_where_each_trial_trained(tmp_path, capsys):
    tuner = _search(tmp_path, "slots", max_trials=4)
    tuner.results_summary()
    printed = capsys.readouterr().out
    for trial_id, path in tuner.trial_paths().items():
        where = f"Path: slot (program {path['program']}, slot {path['slot']}): {path['why']}"
        assert where in printed, (trial_id, printed)


def test_the_default_executor_is_slots_on_jax_and_packs_elsewhere(tmp_path):
    """`executor="auto"` (the default): slots where each new pack's XLA compile is what a
    search waits for (JAX), packs on TensorFlow and torch."""
    tuner = kg.tuner.ParallelTuner(
        hypermodel=build, objective="val_loss", max_trials=3, seed=5, directory=str(tmp_path)
    )
    jax = keras.backend.backend() == "jax"
    assert tuner.executor == ("slots" if jax else "pack")
    tuner.search(*_data(), **FIT)
    assert {p["path"] for p in tuner.trial_paths().values()} == {"slot" if jax else "fused"}


def test_trials_of_a_program_that_raised_run_alone_and_the_search_goes_on(tmp_path):
    """A program whose fit raises (one trial's model takes 7 features, the data has 6):
    its trials run alone with KerasTuner's `run_trial`, the bad one fails as in
    KerasTuner, and the grid's remaining trial, which the oracle held back while they were
    pending, still runs."""
    import tuner_helpers as th

    def grid():
        hp = keras_tuner.HyperParameters()
        hp.Choice("mode", ["ok", "bad", "ok2"])
        return keras_tuner.oracles.GridSearchOracle(objective="val_loss", hyperparameters=hp)

    statuses = {}
    for kind in ("kt", "slots"):
        kwargs = dict(oracle=grid(), hypermodel=th.build_wrong_input)
        kwargs.update(directory=str(tmp_path), project_name=kind)
        if kind == "kt":
            tuner = keras_tuner.Tuner(**kwargs)
        else:
            tuner = kg.tuner.ParallelTuner(parallel_trials=4, executor="slots", **kwargs)
        tuner.search(*th.data(), epochs=2, validation_split=0.25, verbose=0, shuffle=False)
        trials = tuner.oracle.trials.values()
        statuses[kind] = {t.hyperparameters["mode"]: t.status for t in trials}
    assert (
        statuses["slots"]
        == statuses["kt"]
        == {
            "ok": "COMPLETED",
            "bad": "FAILED",
            "ok2": "COMPLETED",
        }
    )
