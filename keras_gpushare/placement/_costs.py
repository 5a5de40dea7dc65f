"""Per-layer cost estimates: parameters, bytes, FLOPs and measured time."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

logger = logging.getLogger(__name__)

# Adam keeps two slots per weight; with the gradient that is three more copies of the weights.
OPTIMIZER_COPIES = 3


def _per_sample(shape: Sequence[int | None]) -> int:
    return int(math.prod(d or 1 for d in shape[1:]))


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(keras.backend.standardize_dtype(dtype)).itemsize
    except TypeError:
        return 4


def param_count(layer: keras.layers.Layer) -> int:
    return int(sum(math.prod(v.shape) for v in layer.weights))


def weight_bytes(layer: keras.layers.Layer) -> int:
    """Bytes of weights plus, for trainable ones, gradient and optimizer slots."""
    total = 0
    for v in layer.weights:
        size = math.prod(v.shape) * _itemsize(v.dtype)
        total += size * (1 + (OPTIMIZER_COPIES if v.trainable else 0))
    return int(total)


def activation_bytes(nodes: Sequence[Any]) -> int:
    """Bytes per sample of the outputs of `nodes`."""
    return int(
        sum(_per_sample(t.shape) * _itemsize(t.dtype) for node in nodes for t in node.outputs)
    )


def flops(layer: keras.layers.Layer, nodes: Sequence[Any]) -> float:
    """Estimated forward FLOPs per sample: a multiply-add per weight per output position."""
    total = 0.0
    kernel_params = sum(math.prod(v.shape) for v in layer.trainable_weights if len(v.shape) >= 2)
    for node in nodes:
        for t in node.outputs:
            shape = list(t.shape)
            positions = math.prod(d or 1 for d in shape[1:-1]) if len(shape) > 2 else 1
            if isinstance(layer, keras.layers.Embedding):
                total += _per_sample(shape)
            else:
                total += 2.0 * kernel_params * positions + _per_sample(shape)
    return total


def measure_times(
    nodes_by_layer: dict[str, list[Any]], layers: Sequence[keras.layers.Layer], batch_size: int
) -> list[float]:
    """Times each layer's forward and backward on random inputs, as torchgpipe does."""
    times = []
    for layer in layers:
        node = nodes_by_layer[layer.name][0]
        args, kwargs = node.arguments.fill_in(
            {id(t): _random(t, batch_size) for t in node.input_tensors}
        )

        def step(args: Any = args, kwargs: Any = kwargs, layer: Any = layer) -> None:
            with tf.GradientTape() as tape:
                tape.watch([a for a in tf.nest.flatten(args) if a.dtype.is_floating])
                out = layer(*args, **kwargs)
                loss = tf.add_n(
                    [tf.reduce_sum(o) for o in tf.nest.flatten(out) if o.dtype.is_floating]
                    or [tf.zeros(())]
                )
            tape.gradient(loss, layer.trainable_variables)

        step()
        start, runs = time.perf_counter(), 0
        while runs < 3 or time.perf_counter() - start < 0.05:
            step()
            runs += 1
        times.append((time.perf_counter() - start) / runs)
        logger.debug("Layer '%s': %.3f ms per step.", layer.name, 1e3 * times[-1])
    return times


def _random(t: Any, batch_size: int) -> tf.Tensor:
    shape = [batch_size] + [d or 1 for d in t.shape[1:]]
    dtype = keras.backend.standardize_dtype(t.dtype)
    if "int" in dtype or dtype == "bool":
        return tf.zeros(shape, dtype=dtype)
    return tf.random.normal(shape, dtype=dtype)
