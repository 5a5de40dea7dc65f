"""The GPipe schedule of one train step, with every stage's backward on its own device.

One traced step holds, for each micro-batch `j` and stage `k`, the forward of stage `k` on
`j` under `tf.device(stage k)`; then the loss on the last stage's device; then, stage by
stage in reverse, a stage-local `GradientTape.gradient` under the same device. TensorFlow
partitions the step into one graph per device joined by `_Send`/`_Recv`, and each device's
executor runs as soon as its inputs arrive: stage `k` works on micro-batch `j` while stage
`k + 1` works on `j - 1`. Gradients are summed per stage over the micro-batches and applied
once, with every optimizer update run on its variable's device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import tree

from keras_gpushare import _upstream
from keras_gpushare.placement._graph import StageGraph

logger = logging.getLogger(__name__)


def run_stage(stage: StageGraph, values: dict[int, Any], training: bool | None) -> dict[int, Any]:
    """Runs the stage's nodes on `values` (ids of its inputs to tensors); returns all values."""
    local = dict(values)
    for node in stage.nodes:
        args, kwargs = node.arguments.fill_in(local)
        op = node.operation
        if training is not None and "training" in _upstream.call_context_args(op):
            kwargs["training"] = training
        outputs = op(*args, **kwargs)
        for x, y in zip(node.outputs, tree.flatten(outputs)):
            local[id(x)] = y
    return local


def placed_forward(
    model: keras.Model, stages: Sequence[StageGraph], inputs: Any, training: bool | None
) -> list[Any]:
    """Runs the whole model stage by stage, each under its device; returns the flat outputs."""
    values = {id(t): v for t, v in zip(model.inputs, inputs)}
    for stage in stages:
        with tf.device(stage.device):
            local = {i: tf.identity(values[i]) for i in stage.inputs}
            local = run_stage(stage, local, training)
        values.update({i: local[i] for i in stage.outputs})
    return [values[id(t)] for t in model.outputs]


def _split(structure: Any, sizes: Any) -> list[Any]:
    """Splits every tensor of a structure along axis 0 into parts of the given `sizes`."""
    if structure is None:
        return [None] * len(sizes)
    flat = tree.flatten(structure)
    parts = [tf.split(t, sizes, axis=0) if t is not None else None for t in flat]
    return [
        tree.pack_sequence_as(structure, [p[j] if p is not None else None for p in parts])
        for j in range(len(sizes))
    ]


def microbatch_sizes(batch: int | tf.Tensor, microbatches: int) -> list[Any]:
    """Rows of each micro-batch of a batch: as equal as possible, the larger ones first.

    A batch of 6 rows in 4 micro-batches gives `[2, 2, 1, 1]` (as `numpy.array_split` and
    torchgpipe's uneven `chunk`). `batch` is an int when the batch size is static, else a
    scalar tensor; the sizes are then tensors too.
    """
    quotient, remainder = batch // microbatches, batch % microbatches
    if isinstance(batch, int):
        return [quotient + (1 if j < remainder else 0) for j in range(microbatches)]
    return [quotient + tf.cast(j < remainder, batch.dtype) for j in range(microbatches)]


def _sum(grads: list[Any]) -> Any:
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    if len(grads) == 1:
        return grads[0]
    return tf.add_n([tf.convert_to_tensor(g) for g in grads])


def _batch_size(x_flat: list[tf.Tensor], microbatches: int) -> int | tf.Tensor:
    """The batch size, static when known; a batch with fewer rows than micro-batches fails."""
    static = x_flat[0].shape[0]
    if microbatches == 1:
        return int(static) if static is not None else tf.shape(x_flat[0])[0]
    message = (
        f"Invalid batch for `microbatches={microbatches}`: a batch of fewer than "
        f"{microbatches} samples leaves a micro-batch empty. Pass a `batch_size` of at "
        f"least {microbatches} and drop a last batch of fewer than {microbatches} samples, "
        "or batch a tf.data.Dataset with `drop_remainder=True`."
    )
    if static is not None:
        if static < microbatches:
            raise ValueError(f"{message} Received a batch of {static} samples.")
        return int(static)
    batch = tf.shape(x_flat[0])[0]
    check = tf.debugging.assert_greater_equal(batch, microbatches, message=message)
    with tf.control_dependencies([check]):
        return tf.identity(batch)


class _Microbatch:
    """What the backward of one micro-batch needs from its forward."""

    def __init__(self) -> None:
        self.values: dict[int, Any] = {}
        self.stage_inputs: list[dict[int, Any]] = []
        self.stage_locals: list[dict[int, Any]] = []
        self.tapes: list[tf.GradientTape | None] = []


def pipelined_train_step(
    model: keras.Model,
    stages: Sequence[StageGraph],
    data: Any,
    microbatches: int,
    recompute: bool,
) -> dict[str, Any]:
    """One training step of a placed model: GPipe forward/backward and one update."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    first, last = stages[0].device, stages[-1].device
    with tf.device(first):
        x_flat = _upstream.standardize_inputs(model, x)
        batch = _batch_size(x_flat, microbatches)
        sizes = microbatch_sizes(batch, microbatches)
        x_parts = [tf.split(t, sizes, axis=0) for t in x_flat]
    with tf.device(last):
        y_parts = _split(y, sizes)
        sw_parts = _split(sample_weight, sizes)
    losses, y_preds = [], []
    grads: list[dict[int, list[Any]]] = [{} for _ in stages]
    for j in range(microbatches):
        mb = _Microbatch()
        mb.values = {id(t): parts[j] for t, parts in zip(model.inputs, x_parts)}
        _forward(model, stages, mb, recompute)
        flat_out = [mb.values[id(t)] for t in model.outputs]
        y_pred = _pack_outputs(model, flat_out)
        y_preds.append(flat_out)
        x_j = tree.pack_sequence_as(_upstream.inputs_struct(model), [p[j] for p in x_parts])
        with tf.device(last):
            with tf.GradientTape(persistent=bool(model.losses)) as tape:
                # Keras computes cross-entropy from the logits behind a softmax/sigmoid
                # output (`_keras_logits`), so both must be watched.
                watched = flat_out + [_upstream.logits_of(o) for o in flat_out if _has_logits(o)]
                tape.watch(watched)
                loss = _upstream.compute_loss(
                    model, x_j, y_parts[j], y_pred, sw_parts[j], training=True
                )
                # Micro-batch j's mean loss weighs by its share of the batch's rows, so
                # the sum is the batch's mean loss also when the micro-batches are uneven.
                loss = loss * (tf.cast(sizes[j], loss.dtype) / tf.cast(batch, loss.dtype))
                scaled = model.optimizer.scale_loss(loss) if model.optimizer else loss
            losses.append(loss)
            all_grads = tape.gradient(scaled, watched)
            out_grads = all_grads[: len(flat_out)]
            with_logits = [id(t) for t, o in zip(model.outputs, flat_out) if _has_logits(o)]
            logit_grads = dict(zip(with_logits, all_grads[len(flat_out) :]))
        if model.losses:
            for k, stage in enumerate(stages):
                with tf.device(stage.device):
                    for v, g in zip(
                        stage.trainable_variables,
                        tape.gradient(scaled, stage.trainable_variables),
                    ):
                        grads[k].setdefault(id(v), []).append(g)
        del tape
        _backward(model, stages, mb, out_grads, logit_grads, grads, recompute)

    trainable, applied = [], []
    for k, stage in enumerate(stages):
        with tf.device(stage.device):
            for v in stage.trainable_variables:
                g = _sum(grads[k].get(id(v), []))
                if g is not None:
                    trainable.append(v)
                    applied.append(g)
    if len(trainable) < len(model.trainable_variables):
        logger.warning(
            "%d trainable variables got no gradient in this step.",
            len(model.trainable_variables) - len(trainable),
        )
    with tf.device(last):
        if trainable:
            with colocated_updates(model.optimizer, variable_devices(stages)):
                model.optimizer.apply(applied, trainable)
        total = tf.add_n(losses)
        _upstream.loss_tracker(model).update_state(total, sample_weight=tf.shape(x_flat[0])[0])
        outputs = [tf.concat(list(parts), axis=0) for parts in zip(*y_preds)]
        return model.compute_metrics(
            x, y, _pack_outputs(model, outputs), sample_weight=sample_weight
        )


def _has_logits(tensor: Any) -> bool:
    return _upstream.logits_of(tensor) is not None


def _pack_outputs(model: keras.Model, flat: list[Any]) -> Any:
    packed = tree.pack_sequence_as(_upstream.outputs_struct(model), flat)
    if isinstance(packed, (list, tuple)) and len(packed) == 1:
        return packed[0]
    return packed


def _forward(
    model: keras.Model, stages: Sequence[StageGraph], mb: _Microbatch, recompute: bool
) -> None:
    for stage in stages:
        with tf.device(stage.device):
            inputs = {i: tf.identity(mb.values[i]) for i in stage.inputs}
            if recompute:
                tape = None
                local = run_stage(stage, inputs, training=True)
            else:
                with tf.GradientTape() as tape:
                    tape.watch([inputs[i] for i in _grad_inputs(model, inputs)])
                    local = run_stage(stage, inputs, training=True)
        mb.stage_inputs.append(inputs)
        mb.stage_locals.append(local)
        mb.tapes.append(tape)
        mb.values.update({i: local[i] for i in stage.outputs})


def _grad_inputs(model: keras.Model, inputs: dict[int, Any]) -> list[int]:
    """The stage inputs that carry a gradient: float tensors that are not model inputs."""
    model_inputs = {id(t) for t in model.inputs}
    return [i for i, t in inputs.items() if i not in model_inputs and t.dtype.is_floating]


def _backward(
    model: keras.Model,
    stages: Sequence[StageGraph],
    mb: _Microbatch,
    out_grads: list[Any],
    logit_grads: dict[int, Any],
    grads: list[dict[int, list[Any]]],
    recompute: bool,
) -> None:
    logit_grads = {i: g for i, g in logit_grads.items() if g is not None}
    pending: dict[int, list[Any]] = {}
    for t, g in zip(model.outputs, out_grads):
        if g is not None:
            pending.setdefault(id(t), []).append(g)
    for k in reversed(range(len(stages))):
        stage = stages[k]
        with tf.device(stage.device):
            wanted = [i for i in stage.outputs if pending.get(i)]
            logits = [i for i in stage.outputs if i in logit_grads]
            if not wanted and not logits:
                continue
            upstream = [_sum(pending.pop(i)) for i in wanted] + [logit_grads[i] for i in logits]
            inputs = mb.stage_inputs[k]
            if recompute:
                with tf.GradientTape() as tape:
                    tape.watch([inputs[i] for i in _grad_inputs(model, inputs)])
                    local = run_stage(stage, inputs, training=True)
            else:
                tape, local = mb.tapes[k], mb.stage_locals[k]
            sources_in = _grad_inputs(model, inputs)
            variables = stage.trainable_variables
            result = tape.gradient(
                [local[i] for i in wanted] + [_upstream.logits_of(local[i]) for i in logits],
                [inputs[i] for i in sources_in] + variables,
                output_gradients=upstream,
            )
            for i, g in zip(sources_in, result[: len(sources_in)]):
                if g is not None:
                    pending.setdefault(i, []).append(g)
            for v, g in zip(variables, result[len(sources_in) :]):
                grads[k].setdefault(id(v), []).append(g)


def variable_devices(stages: Sequence[StageGraph]) -> dict[int, str]:
    """Maps each model variable (by id of its `tf.Variable`) to its stage's device."""
    return {
        id(v.value): stage.device
        for stage in stages
        for layer in stage.layers
        for v in layer.weights
    }


@contextlib.contextmanager
def colocated_updates(
    optimizer: keras.optimizers.Optimizer, devices: dict[int, str]
) -> Iterator[None]:
    """Runs the optimizer's per-variable work (slots, updates, decay) on each variable's device.

    Keras's TensorFlow optimizer creates slots "colocated" only when built eagerly, and runs
    every update under the caller's device. Inside this context the optimizer instance builds
    each slot under the device of its model variable and runs each `update_step` and weight
    decay there too (`devices` maps `id(variable.value)` to a device; inside a traced
    function a captured variable no longer reports its device). The instance is restored on
    exit, so nothing persists beyond the build or the trace.
    """

    def device_of(variable: Any) -> str:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        return devices.get(id(value)) or getattr(value, "device", "") or ""

    patched = {
        "update_step": _on_variable_device(optimizer.update_step, 1, device_of),
        "add_variable_from_reference": _on_variable_device(
            optimizer.add_variable_from_reference, 0, device_of
        ),
        _upstream.APPLY_WEIGHT_DECAY: _decay_per_device(
            _upstream.apply_weight_decay(optimizer), device_of
        ),
    }
    for name, fn in patched.items():
        object.__setattr__(optimizer, name, fn)
    try:
        yield
    finally:
        for name in patched:
            object.__delattr__(optimizer, name)


def _on_variable_device(method: Any, variable_arg: int, device_of: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with tf.device(device_of(args[variable_arg])):
            return method(*args, **kwargs)

    return wrapper


def _decay_per_device(method: Any, device_of: Any) -> Any:
    def wrapper(variables: Sequence[Any]) -> Any:
        by_device: dict[str, list[Any]] = {}
        for v in variables:
            by_device.setdefault(device_of(v), []).append(v)
        for device, group in by_device.items():
            with tf.device(device):
                method(group)

    return wrapper
