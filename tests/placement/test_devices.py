"""Each stage's forward, backward, weights, slots and optimizer updates run on its device.

Checked in the traced train step (the graph Keras's `fit` runs), not by trusting scopes.
"""

import collections
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from hang_guard import HANG_GUARD_S
from placement_models import data

import keras_gpushare as kg

# Ops that carry no requested device in a traced function: the placer pins resource reads
# to the variable's device, and function inputs/outputs belong to the caller.
UNPLACED_OK = {"ReadVariableOp", "Placeholder", "Identity", "NoOp"}


def _short(device):
    return device.split("device:")[-1] if device else ""


@pytest.fixture(scope="module")
def traced():
    inputs = keras.Input((6,))
    with kg.stage("/CPU:1"):
        h = keras.layers.Dense(8, activation="relu", name="first")(inputs)
    with kg.stage("/CPU:2"):
        outputs = keras.layers.Dense(3, name="second")(h)
    model = kg.PlacedModel(inputs, outputs, microbatches=2)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data("mlp", n=8)
    model.fit(x, y, batch_size=4, verbose=0)
    step = tf.function(model.train_step)
    graph = step.get_concrete_function(
        (tf.TensorSpec([8, 6], tf.float32), tf.TensorSpec([8, 3], tf.float32))
    ).graph
    return model, graph.get_operations()


def test_forward_and_backward_ops_on_stage_devices(traced):
    _, ops = traced
    for layer, device in (("first", "CPU:1"), ("second", "CPU:2")):
        placed = [op for op in ops if op.type not in UNPLACED_OK]
        forward = [op for op in placed if op.name.startswith(f"{layer}_")]
        backward = [op for op in placed if op.name.startswith(f"gradient_tape/{layer}_")]
        assert {op.type for op in forward} >= {"MatMul", "BiasAdd"}
        assert {op.type for op in backward} >= {"MatMul", "BiasAddGrad"}
        assert {_short(op.device) for op in forward + backward} == {device}


def test_optimizer_updates_on_stage_devices(traced):
    model, ops = traced
    # Keras makes optimizer names unique in a session ("adam", "adam_3", ...).
    scope = f"{model.optimizer.name}/"
    updates = collections.Counter(
        (_short(op.device), op.type) for op in ops if op.name.startswith(scope)
    )
    # Adam updates two variables per stage: two AssignSub and four AssignAdd ops each.
    for device in ("CPU:1", "CPU:2"):
        assert updates[(device, "AssignSubVariableOp")] == 2
        assert updates[(device, "AssignAddVariableOp")] == 4
        assert updates[(device, "Sqrt")] == 4
    assert {d for d, t in updates if t not in UNPLACED_OK} == {"CPU:1", "CPU:2"}


def test_no_op_left_on_the_default_device(traced):
    _, ops = traced
    unplaced = sorted({op.type for op in ops if not op.device} - UNPLACED_OK)
    assert unplaced == []
    assert not [op.name for op in ops if _short(op.device) in ("CPU:0", "CPU:3")]


def test_variables_and_optimizer_slots_on_stage_devices(traced):
    model, _ = traced
    opt = model.optimizer
    for layer, device in (("first", "CPU:1"), ("second", "CPU:2")):
        for v in model.get_layer(layer).weights:
            assert _short(v.value.device) == device
            i = opt._get_variable_index(v)
            assert _short(opt._momentums[i].value.device) == device
            assert _short(opt._velocities[i].value.device) == device


def test_split_model_moves_existing_weights_and_keeps_values():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")]
    )
    before = model.get_weights()
    placed = kg.split_model(model, ["/CPU:3", "/CPU:1"])
    assert [_short(v.value.device) for v in placed.weights] == ["CPU:3"] * 2 + ["CPU:1"] * 2
    for a, b in zip(before, placed.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_share_gpu_carves_cpu_in_a_fresh_process():
    code = (
        "import keras_gpushare as kg; print(kg.share_gpu(split=3)); "
        "import tensorflow as tf; print(len(tf.config.list_logical_devices('CPU')))"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["['/CPU:0', '/CPU:1', '/CPU:2']", "3"]


def test_share_gpu_after_initialization_is_a_clear_error():
    with pytest.raises(RuntimeError, match="after TensorFlow initialized its devices"):
        kg.share_gpu(split=2)


def test_share_gpu_rejects_bad_split():
    with pytest.raises(ValueError, match="Invalid value for argument `split`"):
        kg.share_gpu(split=0)
