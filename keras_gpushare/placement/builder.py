"""`stage()` and `PlacedModel`: a Functional model whose layers each run on a stage's device."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_gpushare import _upstream
from keras_gpushare.placement import _graph
from keras_gpushare.placement._strategy import check_no_strategy, check_optimizer
from keras_gpushare.placement.pipeline import (
    colocated_updates,
    pipelined_train_step,
    placed_forward,
    variable_devices,
)
from keras_gpushare.placement.plan import Plan, make_plan

logger = logging.getLogger(__name__)

_MARKER_PREFIX = "kg_stage_"
_counter = itertools.count()
_registry: dict[str, str] = {}  # stage marker -> device
_active = threading.local()


class stage:
    """Places the layers called inside it on one device, while building a Functional model.

    Every layer first called inside a `with kg.stage(device):` block belongs to that stage:
    its weights are created on `device`, and a `kg.PlacedModel` built from the resulting
    tensors runs the layer's forward, backward and optimizer updates there. Each block is
    one stage; stages follow the order of the blocks. Layers called outside any block join
    the latest stage that feeds them.

    Args:
        device: Name of a device TensorFlow knows, such as `"/GPU:1"` or `"/CPU:0"`.

    Example:

    ```python
    import keras
    import keras_gpushare as kg

    inputs = keras.Input((8,))
    with kg.stage("/CPU:0"):
        h = keras.layers.Dense(16, activation="relu")(inputs)
    with kg.stage("/CPU:0"):
        outputs = keras.layers.Dense(1)(h)
    model = kg.PlacedModel(inputs, outputs)
    ```
    """

    def __init__(self, device: str) -> None:
        self.device = _graph.canonical_device(device, what="device for `kg.stage`")
        self.marker = f"{_MARKER_PREFIX}{next(_counter)}"
        self._scopes: list[Any] = []

    def __enter__(self) -> stage:
        check_no_strategy(f"opening `kg.stage({self.device!r})`")
        if getattr(_active, "stage", None) is not None:
            raise ValueError(
                f"Invalid nesting: `kg.stage({self.device!r})` was opened inside "
                f"`kg.stage({_active.stage.device!r})`. A layer belongs to one stage; "
                "close the first block before opening the next."
            )
        _registry[self.marker] = self.device
        _active.stage = self
        self._scopes = [keras.name_scope(self.marker), tf.device(self.device)]
        for scope in self._scopes:
            scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for scope in reversed(self._scopes):
            scope.__exit__(*exc)
        self._scopes = []
        _active.stage = None


def _stages_from_scopes(model: keras.Model) -> tuple[list[str], dict[str, int]]:
    """Reads which `kg.stage` block each layer was first called in."""
    layers = _graph.ordered_layers(model)
    marker_of: dict[str, str] = {}
    for layer in layers:
        path = _upstream.name_scope_path(layer)
        found = [p for p in path.split("/") if p in _registry]
        if found:
            marker_of[layer.name] = found[-1]
    if not marker_of:
        raise ValueError(
            "Invalid `PlacedModel`: no layer was called inside a `kg.stage(device)` block, "
            "so there is nothing to place. Build the model inside `with kg.stage(...)` "
            "blocks, or split an existing model with `kg.split_model(model, devices=[...])`."
        )
    markers = sorted(set(marker_of.values()), key=lambda m: int(m[len(_MARKER_PREFIX) :]))
    index = {m: k for k, m in enumerate(markers)}
    devices = [_registry[m] for m in markers]
    layer_stages: dict[str, int] = {}
    for node in _graph.ordered_nodes(model):
        name = node.operation.name
        if name in layer_stages:
            continue
        if name in marker_of:
            layer_stages[name] = index[marker_of[name]]
        else:
            feeding = [
                layer_stages.get(_upstream.producing_layer(t).name, 0) for t in node.input_tensors
            ]
            layer_stages[name] = max(feeding, default=0)
            logger.debug("Layer '%s' joins stage %d.", name, layer_stages[name])
    return devices, layer_stages


class _Placement:
    """Untracked holder of the stage graphs (Keras must not track them as state)."""

    def __init__(self, stages: list[_graph.StageGraph]) -> None:
        self.stages = stages


@keras.saving.register_keras_serializable(package="keras_gpushare")
class PlacedModel(keras.Model):
    """A Keras Functional model split into stages, each on its own device, pipelined.

    Build it from tensors made inside `kg.stage(device)` blocks, or get one from
    `kg.split_model`. Each stage's forward ops, backward ops, weights, optimizer slots and
    optimizer updates run on its device; only activations and their gradients cross.
    With `microbatches=M`, each training batch is cut into `M` micro-batches that flow
    through the stages in a GPipe schedule, and their gradients are summed and applied once,
    so the update equals the full-batch update for models without batch-coupled layers.
    XLA compiles a function onto one device, so a placed model always runs with
    `jit_compile=False`. It chooses its devices itself, so it is built, compiled and fit
    outside any `tf.distribute` strategy scope; inside one, each of these raises a
    `ValueError` before any work.

    Args:
        inputs: The model's input tensor(s), as for `keras.Model(inputs, outputs)`.
        outputs: The model's output tensor(s).
        name: Name of the model. Defaults to `None`.
        microbatches: Number of micro-batches each training batch is cut into, as equal
            as the batch allows (a batch of 6 in 4: 2, 2, 1, 1 rows); every batch needs at
            least as many rows. Defaults to `1`.
        recompute: Whether to keep only the activations at stage borders and recompute
            each stage's forward during its backward (re-materialization), trading about
            a third more compute for activation memory. Defaults to `False`.
        devices: One device per stage, when not built with `kg.stage`. Defaults to `None`.
        layer_stages: Stage index of each layer, by layer name, when not built with
            `kg.stage`. Defaults to `None`.
        **kwargs: Passed to `keras.Model`.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_gpushare as kg

    inputs = keras.Input((8,))
    with kg.stage("/CPU:0"):
        h = keras.layers.Dense(16, activation="relu")(inputs)
    with kg.stage("/CPU:0"):
        outputs = keras.layers.Dense(1)(h)
    model = kg.PlacedModel(inputs, outputs, microbatches=2)
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 8)), np.ones((8, 1)), batch_size=4, verbose=0)
    print(model.plan)
    ```
    """

    def __init__(
        self,
        inputs: Any,
        outputs: Any,
        name: str | None = None,
        *,
        microbatches: int = 1,
        recompute: bool = False,
        devices: Sequence[str] | None = None,
        layer_stages: dict[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        check_no_strategy("building a `PlacedModel`", devices)
        if not isinstance(microbatches, (int, np.integer)) or microbatches < 1:
            raise ValueError(
                f"Invalid value for argument `microbatches`: {microbatches!r}. Expected a "
                "positive integer, such as 4 (batches are cut into that many parts)."
            )
        super().__init__(inputs=inputs, outputs=outputs, name=name, **kwargs)
        if (devices is None) != (layer_stages is None):
            raise ValueError(
                "Invalid arguments: pass both `devices` and `layer_stages`, or neither "
                f"(then `kg.stage` blocks decide). Received devices={devices!r}, "
                f"layer_stages={'None' if layer_stages is None else '{...}'}."
            )
        if devices is None or layer_stages is None:  # both or neither (checked above)
            devices, layer_stages = _stages_from_scopes(self)
        devices = [_graph.canonical_device(d, what="stage device") for d in devices]
        layer_stages = dict(layer_stages)
        missing = [layer.name for layer in _graph.ordered_layers(self)]
        missing = [n for n in missing if n not in layer_stages]
        if missing:
            raise ValueError(
                f"Invalid `layer_stages`: no stage for layers {missing}. Give every layer "
                "of the model a stage index."
            )
        bad = {n: k for n, k in layer_stages.items() if not 0 <= k < len(devices)}
        if bad:
            raise ValueError(
                f"Invalid `layer_stages`: stage indices {bad} are outside 0..{len(devices) - 1} "
                f"for {len(devices)} devices."
            )
        stages = _graph.build_stage_graphs(self, layer_stages, devices)
        for st in stages:
            for layer in st.layers:
                _graph.move_variables(layer, st.device)
        self.microbatches = int(microbatches)
        self.recompute = bool(recompute)
        self._devices = list(devices)
        self._layer_stages = layer_stages
        self._placement = _Placement(stages)
        logger.info("Placed %d layers on %d stages: %s.", len(layer_stages), len(stages), devices)

    @property
    def devices(self) -> list[str]:
        """The device of each stage, in order."""
        return list(self._devices)

    @property
    def plan(self) -> Plan:
        """The placement `Plan`, with memory estimated at batch size 32."""
        return self.get_plan()

    def get_plan(self, batch_size: int = 32) -> Plan:
        """Returns the placement `Plan`, with activation memory estimated at `batch_size`.

        Args:
            batch_size: Batch size used to estimate activation memory. Defaults to `32`.
        """
        return make_plan(self._placement.stages, batch_size, self.microbatches, self.recompute)

    def call(self, inputs: Any, training: bool | None = None, mask: Any = None) -> Any:
        check_no_strategy("calling a `PlacedModel`", self._devices)
        flat = _upstream.standardize_inputs(self, inputs)
        outputs = placed_forward(self, self._placement.stages, flat, training)
        packed = tree.pack_sequence_as(_upstream.outputs_struct(self), outputs)
        if isinstance(packed, (list, tuple)) and len(packed) == 1:
            return packed[0]
        return packed

    def compile(self, *args: Any, jit_compile: bool | str = "auto", **kwargs: Any) -> None:
        check_no_strategy("compiling a `PlacedModel`", self._devices)
        if jit_compile is True:
            raise ValueError(
                "Invalid value for argument `jit_compile`: True. XLA compiles a function "
                "onto one device and ignores `tf.device`, so a placed model cannot run "
                f"under XLA across {self._devices}. Pass `jit_compile=False` (or leave it "
                "as 'auto')."
            )
        check_optimizer(kwargs.get("optimizer", args[0] if args else None))
        super().compile(*args, jit_compile=False, **kwargs)
        if self.optimizer is not None and not self.optimizer.built:
            with colocated_updates(self.optimizer, variable_devices(self._placement.stages)):
                self.optimizer.build(self.trainable_variables)

    def get_compile_config(self) -> dict[str, Any] | None:
        return super().get_compile_config()

    def compile_from_config(self, config: dict[str, Any]) -> None:
        self.compile(**keras.saving.deserialize_keras_object(config))

    def make_train_function(self, force: bool = False) -> Any:
        check_no_strategy("training a `PlacedModel`", self._devices)
        if self.jit_compile:
            raise ValueError(
                "Invalid setting `jit_compile=True` on a placed model: XLA compiles onto "
                "one device and ignores `tf.device`. Set `model.jit_compile = False`."
            )
        return super().make_train_function(force=force)

    def make_test_function(self, force: bool = False) -> Any:
        check_no_strategy("evaluating a `PlacedModel`", self._devices)
        return super().make_test_function(force=force)

    def make_predict_function(self, force: bool = False) -> Any:
        check_no_strategy("predicting with a `PlacedModel`", self._devices)
        return super().make_predict_function(force=force)

    def train_step(self, data: Any) -> dict[str, Any]:
        return pipelined_train_step(
            self, self._placement.stages, data, self.microbatches, self.recompute
        )

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, **kwargs: Any):
        check_no_strategy("fitting a `PlacedModel`", self._devices)
        _check_microbatches(x, batch_size, self.microbatches, kwargs, self)
        return super().fit(x, y, batch_size=batch_size, **kwargs)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            microbatches=self.microbatches,
            recompute=self.recompute,
            devices=list(self._devices),
            layer_stages=dict(self._layer_stages),
        )
        return config


def _check_microbatches(
    x: Any, batch_size: int | None, microbatches: int, fit_kwargs: dict[str, Any], model: Any
) -> None:
    """Checks, before training, that every batch `fit` reaches fills all micro-batches.

    A batch of `B >= microbatches` rows is cut into micro-batches of `B // microbatches` or
    one row more (the pipeline weighs each one's loss by its rows); a batch with fewer rows
    would leave a micro-batch empty. A short last batch is only refused when `fit` reaches
    it: with `steps_per_epoch`, Keras carries its iterator over epochs, so the last of `n`
    batches is reached once `steps_per_epoch` (rounded up to `steps_per_execution`) times
    the epochs run is at least `n`.
    """
    if microbatches == 1 or x is None:
        return
    if isinstance(x, tf.data.Dataset):
        first = tree.flatten(x.element_spec)[0].shape[0]
        if first is not None and first < microbatches:
            raise ValueError(
                f"Invalid batch for `microbatches={microbatches}`: the dataset's batches of "
                f"{first} samples do not fill {microbatches} micro-batches. Batch it with "
                f"at least {microbatches} samples per batch."
            )
        return
    leaves = [t for t in tree.flatten(x) if hasattr(t, "shape")]
    if not leaves:
        return
    n = int(leaves[0].shape[0])
    split = fit_kwargs.get("validation_split") or 0.0
    if split and fit_kwargs.get("validation_data") is None:
        n = int(math.floor(n * (1.0 - split)))
    if n == 0:
        return
    batch = batch_size or 32
    batches = -(-n // batch)
    first, last = min(batch, n), n - (batches - 1) * batch
    if first < microbatches:
        raise ValueError(
            f"Invalid value for argument `batch_size`: batches of {first} samples do not "
            f"fill `microbatches={microbatches}` micro-batches (batch_size={batch_size}, "
            f"samples={n}). Pass batch_size={microbatches} or more."
        )
    if last < microbatches and _reaches_last_batch(fit_kwargs, batches, model):
        raise ValueError(
            f"Invalid batch for `microbatches={microbatches}`: the last batch of {last} "
            f"samples does not fill {microbatches} micro-batches (batch_size={batch}, "
            f"samples={n}). Pass {n - last} samples (drop the last {last}), a `batch_size` "
            f"whose last batch has at least {microbatches} samples, or a `steps_per_epoch` "
            "that stops before the last batch."
        )


def _reaches_last_batch(fit_kwargs: dict[str, Any], batches: int, model: Any) -> bool:
    steps = fit_kwargs.get("steps_per_epoch")
    if steps is None:
        return True
    per_execution = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    per_epoch = -(-int(steps) // per_execution) * per_execution
    epochs = int(fit_kwargs.get("epochs", 1)) - int(fit_kwargs.get("initial_epoch", 0))
    return per_epoch * epochs >= batches
