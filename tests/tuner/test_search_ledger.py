"""A search's log says how many programs it compiled and what share of their FLOPs trained
no trial (padding to a program's widest trial, free or stopped slots).

Backend-neutral (make test runs it on TensorFlow and JAX).
"""

import logging
import re

import keras
import keras_tuner
import pytest
import tuner_helpers as th

import keras_gpushare as kg


def build_dense(hp) -> keras.Model:
    """6 inputs, `units` relu units, one sigmoid output: 2 * (6 * units + units * 1) FLOPs a
    sample, as the planner's cost model counts a dense layer's multiply-adds."""
    units = hp.Choice("units", [8, 16])
    lr = hp.Choice("lr", [0.01])
    keras.utils.set_random_seed(units)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="binary_crossentropy")
    return model


def _search_log(tmp_path, oracle, executor, epochs):
    tuner = kg.tuner.ParallelTuner(
        build_dense,
        oracle=oracle,
        parallel_trials=2,
        executor=executor,
        directory=str(tmp_path),
        project_name=executor,
    )
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("keras_gpushare.tuner")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        x, y = th.data()
        tuner.search(x, y, epochs=epochs, batch_size=16, shuffle=False, verbose=0)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (line,) = [r for r in records if r.startswith("Search: ")]
    return tuner, re.sub(r"\d+\.\d s\)", "<s>)", line)


@pytest.mark.parametrize("executor", ["pack", "slots"])
def test_the_log_gives_the_programs_and_the_share_of_flops_padding(tmp_path, executor):
    """Two trials of 8 and 16 units in one program: each slot computes 16 units, so the
    step computes 2 * 2 * (6 * 16 + 16) FLOPs a sample where the trials need
    2 * (6 * 8 + 8) + 2 * (6 * 16 + 16): a quarter of it is padding."""
    space = keras_tuner.HyperParameters()
    space.Choice("units", [8, 16])
    oracle = keras_tuner.oracles.GridSearchOracle(objective="loss", hyperparameters=space)
    _, line = _search_log(tmp_path, oracle, executor, epochs=2)
    # The slots executor planned its program from two probe builds of the space.
    planned = " (planned from 2 probe builds of the space, <s>)" if executor == "slots" else ""
    assert line == (
        f"Search: 2 trials built, 1 program compiled{planned}; 25% of the FLOPs the programs "
        "computed trained no trial (padding to a program's widest trial, free or stopped slots)."
    )


def test_the_log_counts_trials_loaded_into_freed_slots_and_free_slots(tmp_path):
    """Three trials of one width through two slots, one epoch each: one program; the third
    trial loaded into a slot the first two freed trains while the other slot is free, so
    one slot-epoch of four trained no trial; as `trial_paths` says."""
    space = keras_tuner.HyperParameters()
    space.Choice("units", [8])
    space.Float("lr", 0.01, 0.04)
    oracle = keras_tuner.oracles.RandomSearchOracle(
        objective="loss", hyperparameters=space, max_trials=3, seed=3
    )
    tuner, line = _search_log(tmp_path, oracle, "slots", epochs=1)
    paths = tuner.trial_paths().values()
    assert {path["program"] for path in paths} == {"0"}
    assert sum(path["why"].startswith("loaded into slot") for path in paths) == 1
    assert line == (
        "Search: 3 trials built, 1 program compiled (planned from 2 probe builds of the space, "
        "<s>), 1 trial execution loaded into freed slots; 25% of the FLOPs the programs "
        "computed trained no trial (padding to a program's widest trial, free or stopped "
        "slots)."
    )
