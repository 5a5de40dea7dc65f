"""Placed models under `tf.distribute` strategies: refused before any work, with the reason.

Only the default strategy is supported. A model built under a strategy may be split
outside it: its weights become plain variables on the stage devices.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from placement_models import data, mlp

import keras_gpushare as kg

DEVICES = ["/CPU:2", "/CPU:3"]


@pytest.fixture(scope="module")
def mirrored():
    return tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])


def _compiled_placed():
    placed = kg.split_model(mlp(), DEVICES, microbatches=2)
    placed.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return placed


def _unsplit_weights_after_fit(x, y):
    ref = mlp()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return ref.get_weights()


def test_mirrored_strategy_is_refused_with_the_reason(mirrored):
    with mirrored.scope(), pytest.raises(ValueError) as info:
        kg.split_model(mlp(), DEVICES)
    message = str(info.value)
    for part in (
        "under `tf.distribute.MirroredStrategy` (2 replicas on ['/CPU:0', '/CPU:1'])",
        "splitting a model with `kg.split_model` inside `strategy.scope()` is not supported",
        "every replica would run every stage on those same devices",
        "outside any strategy scope",
        "`kg.ModelPack`",
        "one `PlacedModel` per machine without a strategy",
        "'Under tf.distribute strategies' in docs/placement.md",
    ):
        assert part in message


def test_mirrored_strategy_is_refused_when_building_with_stages(mirrored):
    opening = pytest.raises(ValueError, match=r"opening `kg.stage\('/CPU:2'\)`")
    with mirrored.scope(), opening, kg.stage("/CPU:2"):
        pass
    inputs = keras.Input((6,))
    with kg.stage("/CPU:2"):
        outputs = keras.layers.Dense(3)(inputs)
    with mirrored.scope(), pytest.raises(ValueError, match="building a `PlacedModel`"):
        kg.PlacedModel(inputs, outputs)


def test_model_built_outside_is_refused_at_compile_and_fit_inside(mirrored):
    x, y = data("mlp")
    placed = kg.split_model(mlp(), DEVICES, microbatches=2)
    with mirrored.scope(), pytest.raises(ValueError, match="compiling a `PlacedModel`"):
        placed.compile(optimizer="adam", loss="mse")
    assert not placed.compiled

    placed = _compiled_placed()
    before = placed.get_weights()
    with mirrored.scope():
        with pytest.raises(ValueError, match=r"fitting a `PlacedModel`.*\['/CPU:2', '/CPU:3'\]"):
            placed.fit(x, y, batch_size=8, verbose=0)
        with pytest.raises(ValueError, match="training a `PlacedModel`"):
            placed.train_on_batch(x, y)
        with pytest.raises(ValueError, match="evaluating a `PlacedModel`"):
            placed.evaluate(x, y, verbose=0)
        with pytest.raises(ValueError, match="predicting with a `PlacedModel`"):
            placed.predict(x, verbose=0)
        with pytest.raises(ValueError, match="calling a `PlacedModel`"):
            placed(x)
    assert int(placed.optimizer.iterations) == 0
    for a, b in zip(placed.get_weights(), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda: tf.distribute.OneDeviceStrategy("/CPU:0"),
        lambda: tf.distribute.MirroredStrategy(["/CPU:0"]),
    ],
    ids=["one_device", "mirrored_one_replica"],
)
def test_single_replica_strategy_is_refused(make):
    strategy = make()
    with strategy.scope(), pytest.raises(ValueError, match=r"\(1 replica on \['/CPU:0'\]\)"):
        kg.split_model(mlp(), DEVICES)
    placed = _compiled_placed()
    x, y = data("mlp")
    with strategy.scope(), pytest.raises(ValueError, match="every variable on its one device"):
        placed.fit(x, y, batch_size=8, verbose=0)


def test_optimizer_created_in_a_strategy_scope_is_refused(mirrored):
    with mirrored.scope():
        optimizer = keras.optimizers.Adam()
    placed = kg.split_model(mlp(), DEVICES)
    with pytest.raises(ValueError, match="`optimizer`: Adam was created inside the scope"):
        placed.compile(optimizer=optimizer, loss="mse")


def test_default_strategy_trains_like_no_strategy():
    x, y = data("mlp")
    with tf.distribute.get_strategy().scope():
        placed = _compiled_placed()
        placed.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for w, r in zip(placed.get_weights(), _unsplit_weights_after_fit(x, y)):
        np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)


def test_model_built_under_a_strategy_splits_outside_it(mirrored):
    with mirrored.scope():
        model = mlp()
    # The first stage is the strategy's first device, where the mirrored weights already
    # have a copy: they must still become plain variables.
    placed = kg.split_model(model, ["/CPU:0", "/CPU:3"], microbatches=2)
    for v in placed.weights:
        assert not isinstance(v.value, tf.distribute.DistributedValues)
    assert {v.value.device[-5:] for v in placed.weights} == {"CPU:0", "CPU:3"}
    placed.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = data("mlp")
    placed.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for w, r in zip(placed.get_weights(), _unsplit_weights_after_fit(x, y)):
        np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)
