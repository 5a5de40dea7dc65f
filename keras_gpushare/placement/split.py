"""`split_model`: place an existing Sequential or Functional model over devices."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import keras

from keras_gpushare import _upstream
from keras_gpushare.placement import partition
from keras_gpushare.placement._graph import canonical_device
from keras_gpushare.placement._strategy import check_no_strategy
from keras_gpushare.placement.builder import PlacedModel

logger = logging.getLogger(__name__)


def split_model(
    model: keras.Model,
    devices: Sequence[str],
    balance: str | Sequence[int] | Sequence[str] = "params",
    microbatches: int = 1,
    *,
    recompute: bool = False,
    batch_size: int = 32,
) -> PlacedModel:
    """Splits a Sequential or Functional model into contiguous stages, one per device.

    The layers are taken in topological order and cut into `len(devices)` contiguous
    stages by `balance`; a tensor that a later stage reads (a skip connection) is sent to
    it once. The returned `PlacedModel` shares its layers and weights with `model`: the
    weights move to their stage's device, values kept. Compile the returned model (not
    `model`) to train it placed.

    Args:
        model: A built `keras.Sequential` or Functional `keras.Model`.
        devices: One device name per stage, e.g. `["/GPU:0", "/GPU:1"]`; a device may
            repeat.
        balance: How to cut: `"params"` (equal parameter counts), `"flops"` (estimated
            forward FLOPs), `"memory"` (weights, gradients, optimizer slots and
            activations at `batch_size`), `"time"` (each layer's forward and backward
            measured, as torchgpipe does), a list of stage sizes (`[3, 5]`), or the names
            of the layers that start stages 1, 2, ... Defaults to `"params"`.
        microbatches: Micro-batches per training batch (GPipe). Defaults to `1`.
        recompute: Whether to recompute each stage's forward in its backward. Defaults to
            `False`.
        batch_size: Batch size assumed by the `"memory"` and `"time"` policies. Defaults
            to `32`.

    Returns:
        A `kg.PlacedModel`.

    Example:

    ```python
    import keras
    import keras_gpushare as kg

    model = keras.Sequential(
        [keras.Input((8,))] + [keras.layers.Dense(8, activation="relu") for _ in range(3)]
    )
    placed = kg.split_model(model, devices=["/CPU:0", "/CPU:0"], balance=[1, 2])
    print(placed.plan)
    ```
    """
    check_no_strategy("splitting a model with `kg.split_model`")
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(
            f"Invalid value for argument `devices`: {devices!r}. Expected a non-empty "
            "list of device names, such as ['/GPU:0', '/GPU:1']."
        )
    devices = [canonical_device(d, what="device in `devices`") for d in devices]
    inputs, outputs = _graph_of(model)
    graph = keras.Model(inputs, outputs)
    layer_stages = partition.assign_stages(graph, len(devices), balance, batch_size)
    return PlacedModel(
        inputs,
        outputs,
        name=f"{model.name}_placed",
        microbatches=microbatches,
        recompute=recompute,
        devices=devices,
        layer_stages=layer_stages,
    )


def _graph_of(model: keras.Model) -> tuple[list, list]:
    if isinstance(model, keras.Sequential):
        try:
            return model.inputs, model.outputs
        except (AttributeError, ValueError):
            pass
        raise ValueError(
            f"Invalid model '{model.name}': this Sequential model is not built, so it has "
            "no graph to split. Start it with `keras.Input(shape)` or call "
            "`model.build(input_shape)` first."
        )
    if not isinstance(model, keras.Model) or not _upstream.has_layer_graph(model):
        raise ValueError(
            f"Invalid model {getattr(model, 'name', model)!r} of type "
            f"{type(model).__name__}: a subclassed model has no layer graph to split. "
            "Rebuild it as a Functional or Sequential model, or build it with "
            "`kg.stage(device)` blocks and `kg.PlacedModel(inputs, outputs)`."
        )
    return model.inputs, model.outputs
