"""Bad plans fail before any work, with Keras-style messages."""

import keras
import numpy as np
import pytest
from placement_models import data, mlp

import keras_gpushare as kg


def test_unknown_device():
    with pytest.raises(ValueError, match=r"'/GPU:7'.*no such device.*share_gpu"):
        kg.split_model(mlp(), ["/CPU:0", "/GPU:7"])
    with pytest.raises(ValueError, match="no such device"):
        kg.stage("/CPU:9")


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="5 devices for a model of 4 layers"):
        kg.split_model(mlp(), ["/CPU:0"] * 5)


def test_subclassed_model_has_no_graph():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match="subclassed model has no layer graph to split"):
        kg.split_model(Sub(), ["/CPU:0", "/CPU:1"])


def test_unbuilt_sequential():
    model = keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="not built"):
        kg.split_model(model, ["/CPU:0", "/CPU:1"])


def test_batch_smaller_than_microbatches_says_what_to_pass():
    placed = kg.split_model(mlp(), ["/CPU:1", "/CPU:2"], microbatches=4)
    placed.compile(optimizer="sgd", loss="mse")
    x, y = data("mlp", n=16)
    with pytest.raises(ValueError, match=r"microbatches=4.*Pass batch_size=4"):
        placed.fit(x, y, batch_size=2, verbose=0)
    with pytest.raises(ValueError, match=r"drop the last 2"):
        placed.fit(np.concatenate([x, x[:2]]), np.concatenate([y, y[:2]]), batch_size=8)


def test_jit_compile_true_is_refused():
    placed = kg.split_model(mlp(), ["/CPU:1", "/CPU:2"])
    with pytest.raises(ValueError, match="`jit_compile`: True.*XLA"):
        placed.compile(optimizer="sgd", loss="mse", jit_compile=True)
    placed.compile(optimizer="sgd", loss="mse")
    assert placed.jit_compile is False


def test_bad_balance_values():
    with pytest.raises(ValueError, match=r"Expected 2 positive stage sizes.*balance=\[2, 2\]"):
        kg.split_model(mlp(), ["/CPU:0", "/CPU:1"], balance=[1, 2])
    with pytest.raises(ValueError, match="unknown layers"):
        kg.split_model(mlp(), ["/CPU:0", "/CPU:1"], balance=["nope"])
    with pytest.raises(ValueError, match="Expected one of"):
        kg.split_model(mlp(), ["/CPU:0", "/CPU:1"], balance="speed")
    with pytest.raises(ValueError, match="`microbatches`"):
        kg.split_model(mlp(), ["/CPU:0", "/CPU:1"], microbatches=0)


def test_placed_model_without_stages():
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(inputs)
    with pytest.raises(ValueError, match=r"no layer was called inside a `kg.stage"):
        kg.PlacedModel(inputs, outputs)


def test_nested_stages():
    outer, inner = kg.stage("/CPU:0"), kg.stage("/CPU:1")
    with outer, pytest.raises(ValueError, match="Invalid nesting"):
        inner.__enter__()
