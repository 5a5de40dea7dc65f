"""Stage graphs: a Functional model's nodes grouped into contiguous stages, one device each."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_gpushare import _upstream

logger = logging.getLogger(__name__)


def canonical_device(device: str, *, what: str = "device") -> str:
    """Returns `device` as `/TYPE:index` after checking TensorFlow knows it."""
    if not isinstance(device, str):
        raise TypeError(
            f"Invalid {what}: expected a device name such as '/GPU:0', received "
            f"{device!r} of type {type(device).__name__}."
        )
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"Invalid {what} {device!r}: not a device name ({e}). Pass a name such as "
            "'/GPU:0', '/GPU:1' or '/CPU:0'."
        ) from None
    if not spec.device_type:
        raise ValueError(
            f"Invalid {what} {device!r}: it names no device type. Pass a name such as "
            "'/GPU:0' or '/CPU:0'."
        )
    name = f"/{spec.device_type.upper()}:{spec.device_index or 0}"
    known = available_devices()
    if name not in known:
        raise ValueError(
            f"Invalid {what} {device!r}: TensorFlow has no such device. Devices it "
            f"sees: {known}. Pass one of these, or create logical devices first with "
            "`kg.share_gpu(split=k)` before anything else touches TensorFlow."
        )
    return name


def available_devices() -> list[str]:
    """Returns the logical devices TensorFlow sees, as `/TYPE:index` names."""
    names = []
    for d in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(d.name)
        names.append(f"/{spec.device_type}:{spec.device_index}")
    return names


def same_device(tf_device: str, device: str) -> bool:
    """Whether a TensorFlow device string (full or partial) names `device`."""
    if not tf_device:
        return False
    spec = tf.DeviceSpec.from_string(tf_device)
    return f"/{(spec.device_type or '').upper()}:{spec.device_index or 0}" == device


def ordered_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """Returns the model's non-input layers in the topological order of their first call."""
    seen: dict[int, keras.layers.Layer] = {}
    for node in ordered_nodes(model):
        seen.setdefault(id(node.operation), node.operation)
    return list(seen.values())


def ordered_nodes(model: keras.Model) -> list[Any]:
    """Returns the model's non-input nodes in a topological order."""
    nodes = []
    by_depth = _upstream.nodes_by_depth(model)
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if node.operation is not None and not node.is_input:
                nodes.append(node)
    return nodes


@dataclasses.dataclass
class StageGraph:
    """One stage: its device, its nodes in order, and the tensors that cross its border."""

    index: int
    device: str
    layers: list[keras.layers.Layer]
    nodes: list[Any]
    inputs: list[int]  # ids of KerasTensors read from model inputs or earlier stages
    outputs: list[int]  # ids of KerasTensors produced here and read later or returned

    @property
    def trainable_variables(self) -> list[keras.Variable]:
        return [v for layer in self.layers for v in layer.trainable_variables]


def build_stage_graphs(
    model: keras.Model, layer_stage: dict[str, int], devices: Sequence[str]
) -> list[StageGraph]:
    """Groups the model's nodes into stages and finds what each stage sends and receives."""
    nodes = ordered_nodes(model)
    stages = [StageGraph(k, d, [], [], [], []) for k, d in enumerate(devices)]
    producer: dict[int, int] = {id(t): -1 for t in model.inputs}
    for node in nodes:
        k = layer_stage[node.operation.name]
        stage = stages[k]
        if node.operation not in stage.layers:
            stage.layers.append(node.operation)
        stage.nodes.append(node)
        for t in node.input_tensors:
            src = producer.get(id(t))
            if src is None:
                continue
            if src > k:
                raise ValueError(
                    f"Invalid placement: layer '{node.operation.name}' on stage {k} reads "
                    f"the output of stage {src}. Stages must follow the data flow: a stage "
                    "may only read model inputs and earlier stages. Reorder the "
                    "`kg.stage` blocks or pass a different `balance`."
                )
            if src != k and id(t) not in stage.inputs:
                stage.inputs.append(id(t))
                if src >= 0 and id(t) not in stages[src].outputs:
                    stages[src].outputs.append(id(t))
        for t in node.outputs:
            producer[id(t)] = k
    for t in model.outputs:
        k = producer[id(t)]
        if k >= 0 and id(t) not in stages[k].outputs:
            stages[k].outputs.append(id(t))
    for stage in stages:
        if not stage.nodes:
            raise ValueError(
                f"Invalid placement: stage {stage.index} on {stage.device} holds no layer. "
                "Every stage needs at least one layer; pass fewer devices."
            )
    return stages


def move_variables(layer: keras.layers.Layer, device: str) -> int:
    """Re-creates the layer's variables on `device`, keeping their values; returns how many.

    A variable that a `tf.distribute` strategy created (a model built inside its scope) is
    re-created too, as one plain variable, even if its first copy is already on `device`.
    """
    moved = 0
    for v in layer.weights:
        distributed = isinstance(v.value, tf.distribute.DistributedValues)
        if same_device(v.value.device, device) and not distributed:
            continue
        with tf.device(device):
            value = tf.identity(v.value)
            _upstream.reinitialize_variable(
                v,
                tf.Variable(
                    value,
                    trainable=v.value.trainable,
                    name=v.value.name.split(":")[0],
                    aggregation=v.value.aggregation,
                    synchronization=v.value.synchronization,
                ),
            )
        moved += 1
    if moved:
        logger.debug("Moved %d variables of layer '%s' to %s.", moved, layer.name, device)
    return moved
