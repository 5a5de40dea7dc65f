"""Every private name of Keras, KerasTuner and TensorFlow that keras-gpushare uses.

Keras 3 has no public way to do a few things this package needs: walk a Functional graph in
order, reach a member's compiled loss and metrics, read an optimizer's slot lists, merge a
replica context's updates. Each such use goes through one accessor here, named after what it
gives, and tests/test_upstream.py exercises every accessor on the installed releases. When a
release renames or removes a private name, that test fails and names it, instead of a pack
failing deep inside a traced step.

TensorFlow and KerasTuner are imported inside the accessors that need them, so this module
imports with Keras alone (the fused engine runs on JAX without TensorFlow).

Hooks the package overrides rather than calls (a subclass defines a method of the same name,
which a release may stop calling) are listed in `OVERRIDDEN_HOOKS`; the test checks that each
still exists with the arguments the override takes.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import keras

# (class, method name, argument names the override relies on, Keras backend or None for all)
OVERRIDDEN_HOOKS: tuple[tuple[str, str, tuple[str, ...], str | None], ...] = (
    ("keras.Model", "_symbolic_build", ("iterator", "data_batch"), None),
    ("keras.Model", "_maybe_symbolic_build", ("iterator", "data_batch"), "tensorflow"),
    ("keras.callbacks.BackupAndRestore", "_save_model", (), None),
    ("keras.callbacks.TensorBoard", "_log_weights", ("epoch",), None),
    ("keras_tuner.Tuner", "_build_hypermodel", ("hp",), None),
)

# ---------------------------------------------------------------- Keras: layer graphs


def has_layer_graph(model: Any) -> bool:
    """Whether `model` is a Functional model (a graph of nodes): `_nodes_by_depth`."""
    return hasattr(model, "_nodes_by_depth")


def nodes_by_depth(model: keras.Model) -> dict[int, list[Any]]:
    """A Functional model's nodes keyed by depth (outputs at 0): `_nodes_by_depth`."""
    return model._nodes_by_depth


def sequential_graph(model: keras.Sequential) -> keras.Model | None:
    """The Functional model inside a built Sequential, or None: `_functional`."""
    return getattr(model, "_functional", None)


def inputs_struct(model: keras.Model) -> Any:
    """The nested structure (dict, list, tensor) of a Functional model's inputs:
    `_inputs_struct`; None for a model without one."""
    return getattr(model, "_inputs_struct", None)


def outputs_struct(model: keras.Model) -> Any:
    """The nested structure of a Functional model's outputs: `_outputs_struct`."""
    return model._outputs_struct


def standardize_inputs(model: keras.Model, inputs: Any) -> list[Any]:
    """A Functional model's inputs as its flat, converted list: `_standardize_inputs`."""
    return model._standardize_inputs(inputs)


def producing_layer(tensor: Any) -> Any:
    """The operation (layer) that produced a symbolic tensor: `_keras_history.operation`."""
    return tensor._keras_history.operation


def logits_of(tensor: Any) -> Any:
    """The logits Keras keeps behind a softmax or sigmoid output, or None: `_keras_logits`
    (cross-entropy losses compute from them)."""
    return getattr(tensor, "_keras_logits", None)


def call_context_args(operation: Any) -> frozenset[str]:
    """The call-context arguments (such as `training`) a layer takes in `__call__` and
    hands on to the layers it calls; empty for an operation that is not a layer:
    `_call_context_args` (Keras 3.10 and later; before, every layer's `__call__` took
    `training` and no other)."""
    names = getattr(operation, "_call_context_args", None)
    if names is None:
        return frozenset({"training"} if isinstance(operation, keras.layers.Layer) else ())
    return frozenset(names)


def call_takes_training(layer: Any) -> bool:
    """Whether a layer's `call` takes a `training` argument (False for an operation that is
    not a layer): `_call_has_training_arg`."""
    return getattr(layer, "_call_has_training_arg", False)


def call_takes_mask(layer: Any) -> bool:
    """Whether a layer's `call` takes a `mask` argument (False for an operation that is not
    a layer): `_call_has_mask_arg`."""
    return getattr(layer, "_call_has_mask_arg", False)


def name_scope_path(layer: Any) -> str:
    """The name scopes a layer was first called under, joined by "/" ("" before its first
    call, or outside any scope): `_parent_path`."""
    return getattr(layer, "_parent_path", None) or ""


def untrack_layer(model: keras.Model, layer: Any) -> None:
    """Removes a layer from a model's tracked layers: `_layers`."""
    model._layers.remove(layer)


def all_layers(layer: Any) -> list[Any]:
    """`layer` and every layer it holds, nested ones too, each once, in tracking order (the
    order of `get_weights`): `_flatten_layers`."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


def model_strategy(model: keras.Model) -> Any:
    """The `tf.distribute` strategy a model was built under, or None:
    `_distribute_strategy`."""
    return getattr(model, "_distribute_strategy", None)


def symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """Builds a model's compiled loss and metrics from one batch: `_symbolic_build`
    (`model` may be a `super()` of a subclass that overrides it)."""
    model._symbolic_build(data_batch=data_batch)


def maybe_symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """What the TensorFlow trainer does before its first step, from one batch:
    `_maybe_symbolic_build` (`model` may be a `super()` of a subclass that overrides it)."""
    model._maybe_symbolic_build(iterator=None, data_batch=data_batch)


def keep_jax_state(model: keras.Model, state: tuple) -> None:
    """Hands a JAX training call's state (trainable, non-trainable, optimizer and metrics
    variable values) to `model` as Keras's `fit` loop does after each call, so that
    `jax_state_sync()` (at `fit`'s end, or when it raises) writes it into the variables:
    `_jax_state`, `_jax_state_synced`."""
    keys = ("trainable_variables", "non_trainable_variables", "optimizer_variables")
    model._jax_state = dict(zip((*keys, "metrics_variables"), state))
    model._jax_state_synced = False


def in_xla_context() -> bool:
    """Whether TensorFlow is tracing inside an XLA-compiled function:
    `control_flow_util.GraphOrParentsInXlaContext`."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def epoch_iterator_data(iterator: Any) -> Any:
    """Iterates over what a Keras `EpochIterator` hands to a step function (a batch, a list
    of batches, or a backend iterator), whatever else its entries hold: it yields
    `(step, data)` before Keras 3.11 and `(begin_step, end_step, data)` since."""
    for entry in iterator:
        yield entry[-1]


def fit_epoch_iterator(
    x: Any, batch_size: int | None, shuffle: Any, steps_per_execution: int
) -> Any:
    """The backend's `EpochIterator` over `x` as `fit` makes it for its data
    (`JAXEpochIterator`, `TFEpochIterator` with the current strategy, `TorchEpochIterator`),
    from `keras.src.backend.<backend>.trainer`."""
    backend = keras.backend.backend()
    kwargs = dict(
        x=x, batch_size=batch_size, shuffle=shuffle, steps_per_execution=steps_per_execution
    )
    if backend == "tensorflow":
        import tensorflow as tf
        from keras.src.backend.tensorflow.trainer import TFEpochIterator

        return TFEpochIterator(distribute_strategy=tf.distribute.get_strategy(), **kwargs)
    if backend == "jax":
        from keras.src.backend.jax.trainer import JAXEpochIterator

        return JAXEpochIterator(**kwargs)
    if backend == "torch":
        from keras.src.backend.torch.trainer import TorchEpochIterator

        return TorchEpochIterator(**kwargs)
    from keras.src.trainers.epoch_iterator import EpochIterator

    return EpochIterator(**kwargs)


def train_validation_split(arrays: tuple, validation_split: float) -> tuple[tuple, tuple]:
    """`fit`'s split of its array data by `validation_split` (the last rows validate):
    `keras.src.trainers.data_adapters.array_slicing.train_validation_split`."""
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def tf_seed_state() -> tuple[Any, Any]:
    """TensorFlow's global seed and the state of the generator its eager operations draw
    their seeds from (`tf.random.set_seed` sets both): the eager context's `_seed` and
    `_rng` (absent before any seed is set)."""
    from tensorflow.python.eager import context

    ctx = context.context()
    rng = getattr(ctx, "_rng", None)
    return ctx._seed, None if rng is None else rng.getstate()


def set_tf_seed_state(state: tuple[Any, Any]) -> None:
    """Puts back what `tf_seed_state` read."""
    import random

    from tensorflow.python.eager import context

    ctx = context.context()
    seed, rng_state = state
    ctx._seed = seed
    if rng_state is None:
        if hasattr(ctx, "_rng"):
            del ctx._rng
        return
    rng = random.Random()
    rng.setstate(rng_state)
    ctx._rng = rng


def keras_global_state() -> dict[str, Any]:
    """Keras's global state (`keras.src.backend.common.global_state`: the counters that
    name layers, the global `SeedGenerator` and its state, the global seed), as a copy
    that `set_keras_global_state` puts back: what building a model changes there is undone."""
    from keras.src.backend.common import global_state

    attributes = dict(vars(global_state.GLOBAL_STATE_TRACKER))
    copies = {
        name: copy.copy(value) if isinstance(value, dict) else value
        for name, value in attributes.items()
    }
    generator = attributes.get("global_seed_generator")
    seed = None if generator is None else keras.ops.convert_to_numpy(generator.state.value)
    return {"attributes": copies, "generator": generator, "seed_state": seed}


def set_keras_global_state(state: dict[str, Any]) -> None:
    """Puts back what `keras_global_state` read."""
    from keras.src.backend.common import global_state

    tracker = vars(global_state.GLOBAL_STATE_TRACKER)
    tracker.clear()
    tracker.update(
        {k: copy.copy(v) if isinstance(v, dict) else v for k, v in state["attributes"].items()}
    )
    if state["generator"] is not None:
        state["generator"].state.assign(state["seed_state"])


def tf_global_generator() -> Any:
    """TensorFlow's global `tf.random.Generator` (`stateful_random_ops.global_generator`),
    or `None` before `tf.random.get_global_generator()` made one."""
    from tensorflow.python.ops import stateful_random_ops

    return stateful_random_ops.global_generator


def set_tf_global_generator(generator: Any) -> None:
    """Makes `generator` (or `None`: none yet) TensorFlow's global generator."""
    from tensorflow.python.ops import stateful_random_ops

    stateful_random_ops.global_generator = generator


def epoch_iterator_element_spec(iterator: Any) -> Any:
    """The `tf.TypeSpec` structure of the batches a TensorFlow `TFEpochIterator` yields, or
    None for another iterator: its dataset's `element_spec`, via `_distributed_dataset`."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    return None if dataset is None else dataset.element_spec


def progbar_in_fit(callback: keras.callbacks.ProgbarLogger) -> bool:
    """Whether a `ProgbarLogger` is running inside `fit` (so an evaluation is `fit`'s
    validation, which it does not show): `_called_in_fit`."""
    return callback._called_in_fit


def print_msg(message: str) -> None:
    """Prints a line as Keras's progress bar does (to stdout, or to absl logging when
    interactive logging is off): `keras.src.utils.io_utils.print_msg`."""
    from keras.src.utils import io_utils

    io_utils.print_msg(message)


def reinitialize_variable(variable: keras.Variable, value: Any) -> None:
    """Replaces the backend variable behind a Keras variable (TensorFlow: a new
    `tf.Variable`, e.g. on another device): `_initialize`."""
    variable._initialize(value)


# ---------------------------------------------------------------- Keras: layers


def is_keras_builtin(cls: type, within: str | None = None) -> bool:
    """Whether a class is defined inside Keras itself (in its subpackage `within`, such as
    "optimizers" or "backend", when given): its module starts with `keras.src.`."""
    prefix = "keras.src." if within is None else f"keras.src.{within}."
    return cls.__module__.startswith(prefix)


def keras_mask(tensor: Any) -> Any:
    """The mask Keras attached to a tensor, or None:
    `keras.src.backend.get_keras_mask` (`_keras_mask`)."""
    from keras.src.backend import get_keras_mask

    return get_keras_mask(tensor)


def attention_equations(rank: int, attn_axes: tuple[int, ...]) -> tuple[str, str, int]:
    """`MultiHeadAttention`'s einsum equations for projected tensors of `rank` attending
    over `attn_axes`: (dot-product equation, combine equation, rank of the scores):
    `keras.src.layers.attention.multi_head_attention._build_attention_equation`."""
    from keras.src.layers.attention.multi_head_attention import _build_attention_equation

    return _build_attention_equation(rank, attn_axes=attn_axes)


def backend_rnn(
    step_function: Callable[..., Any], inputs: Any, initial_states: Any, **kwargs: Any
) -> Any:
    """Keras's backend loop behind its recurrent layers, returning (last output, outputs,
    new states): `keras.src.backend.rnn`."""
    from keras.src import backend

    return backend.rnn(step_function, inputs, initial_states, **kwargs)


def conv_transpose_padding_args(**kwargs: Any) -> Any:
    """The (before, after) padding of each spatial axis that makes a dilated convolution
    the transpose of a strided one, as Keras's JAX backend computes it:
    `keras.src.backend.common.backend_utils.compute_conv_transpose_padding_args_for_jax`."""
    from keras.src.backend.common.backend_utils import (
        compute_conv_transpose_padding_args_for_jax as padding_args,
    )

    return padding_args(**kwargs)


# ---------------------------------------------------------------- Keras: compile and losses


def compile_arguments(model: keras.Model) -> dict[str, Any]:
    """The arguments a compiled model's `compile` was given, as objects (the user's own loss
    function or metric, unserialized; `{}` when it was not compiled): `_compile_config`."""
    config = getattr(model, "_compile_config", None) if model.compiled else None
    return {} if config is None else dict(config.config)


def compile_loss(model: keras.Model) -> Any:
    """The `CompileLoss` that `compile(loss=...)` made (callable as `(y, y_pred, sw)`), or
    None: `_compile_loss`."""
    return getattr(model, "_compile_loss", None)


def compile_metrics(model: keras.Model) -> Any:
    """The `CompileMetrics` that `compile(metrics=...)` made, or None: `_compile_metrics`."""
    return getattr(model, "_compile_metrics", None)


def trace_symbolically(function: Any, *args: Any) -> None:
    """Runs `function` on symbolic values (`keras.KerasTensor`s) as Keras's symbolic build
    does, making the state it makes and changing none; its result is dropped:
    `keras.src.backend.compute_output_spec`."""
    from keras.src import backend

    def run(*values: Any) -> tuple:
        function(*values)
        return ()

    backend.compute_output_spec(run, *args)


def metric_state_pending(metric: Any) -> bool:
    """Whether one of Keras's metrics makes its state from the first batch it sees (`AUC`
    with `multi_label=True` and no `num_labels`, `F1Score`/`FBetaScore`, `R2Score`):
    `_built` is False until then."""
    return getattr(metric, "_built", True) is False


def loss_parts(loss: Any) -> list[tuple[Any, Any, Any, Any]]:
    """A built `CompileLoss`'s losses, one `(path, loss, loss_weight, tracker)` per output
    it computes a loss for (`path` into the model's outputs; `tracker`, the `Mean` logged
    as `<output>_loss`, or None for one output): `_flat_losses` and `metrics`."""
    trackers = list(loss.metrics) or [None] * len(loss._flat_losses)
    return [
        (path, fn, weight, tracker)
        for (path, fn, weight, _), tracker in zip(loss._flat_losses, trackers, strict=True)
    ]


def metric_parts(metrics: Any, weighted: bool = False) -> list[tuple[str | None, list[Any]] | None]:
    """A built `CompileMetrics`'s unweighted metrics (`weighted`: its weighted metrics), per
    output in the order of `flat_outputs`: `(output_name, [metric, ...])`, or None for an
    output without any: `_flat_metrics`, `_flat_weighted_metrics`."""
    flat = metrics._flat_weighted_metrics if weighted else metrics._flat_metrics
    return [None if m is None else (m.output_name, list(m.metrics)) for m in flat]


def flat_outputs(metrics: Any, values: Any) -> list[Any]:
    """Labels or predictions laid out as `metric_parts` (a dict by the model's output
    names): `CompileMetrics._flatten_y`."""
    return metrics._flatten_y(values)


def loss_tracker(model: keras.Model) -> Any:
    """The `Mean` metric behind a compiled model's `loss` log: `_loss_tracker`."""
    return model._loss_tracker


def compute_loss(
    model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool
) -> Any:
    """`model.compute_loss`, passing `training` only to overrides that take it:
    `Trainer._compute_loss`."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def model_supports_jit(model: keras.Model) -> bool:
    """Keras's rule for `jit_compile="auto"`: `keras.src.trainers.trainer.model_supports_jit`."""
    from keras.src.trainers.trainer import model_supports_jit as supports

    return supports(model)


def loss_function_wrapper() -> type:
    """The class that makes a `Loss` of a function `fn(y_true, y_pred)` (Keras's own losses
    such as `Huber` subclass it): `keras.src.losses.losses.LossFunctionWrapper`."""
    from keras.src.losses.losses import LossFunctionWrapper

    return LossFunctionWrapper


def wrapped_metric_function(metric: Any) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The function and keyword arguments behind a mean metric made of a function
    (`MeanSquaredError`, `"mae"`, ...: a `MeanMetricWrapper`): `_fn`, `_fn_kwargs`."""
    return metric._fn, metric._fn_kwargs


def metric_built(metric: Any) -> bool:
    """Whether a metric that makes its state on its first update (`F1Score`,
    `R2Score`, ...) has made it; True for the others: `_built`."""
    return bool(getattr(metric, "_built", True))


def scale_loss_for_distribution(value: Any) -> Any:
    """Divides a loss by the number of replicas in sync, as Keras's losses do under a
    strategy: `keras.src.losses.loss.scale_loss_for_distribution`."""
    from keras.src.losses.loss import scale_loss_for_distribution as scale

    return scale(value)


def unscale_loss_for_distribution(value: Any) -> Any:
    """Undoes `scale_loss_for_distribution`:
    `keras.src.losses.loss.unscale_loss_for_distribution`."""
    from keras.src.losses.loss import unscale_loss_for_distribution as unscale

    return unscale(value)


# ---------------------------------------------------------------- Keras: optimizers

# Private slot lists of the built-in optimizers the fused engine vectorizes, one variable per
# model variable in `_get_variable_index` order: Adam/AdamW/Nadam "momentums", "velocities"
# and with amsgrad "velocity_hats"; RMSprop "velocities", with momentum "momentums", centered
# "average_gradients"; Adagrad "accumulators"; Adamax "m", "u"; Adadelta "accumulated_grads",
# "accumulated_delta_vars"; Ftrl "accumulators", "linears"; and any optimizer's
# "accumulated_gradients" with `gradient_accumulation_steps`. (SGD's `momentums` is public.)
_SLOT_LISTS = (
    "momentums",
    "velocities",
    "velocity_hats",
    "average_gradients",
    "accumulators",
    "m",
    "u",
    "accumulated_grads",
    "accumulated_delta_vars",
    "linears",
    "accumulated_gradients",
)


def slot_list(optimizer: keras.optimizers.Optimizer, name: str) -> list[Any]:
    """One of an optimizer's private slot lists, by its name without the underscore:
    `_momentums`, `_velocities`, `_velocity_hats`, `_average_gradients`, `_accumulators`,
    `_m`, `_u`, `_accumulated_grads`, `_accumulated_delta_vars`, `_linears`,
    `_accumulated_gradients`."""
    if name not in _SLOT_LISTS:
        raise ValueError(f"Unknown slot list {name!r}; expected one of {_SLOT_LISTS}.")
    return getattr(optimizer, f"_{name}")


def nadam_u_product(optimizer: keras.optimizers.Nadam) -> keras.Variable:
    """The variable in which `Nadam` keeps the product of its momentum schedule's factors
    (`u_t`), multiplied once per step: `_u_product`."""
    return optimizer._u_product


def raw_learning_rate(optimizer: keras.optimizers.Optimizer) -> Any:
    """The learning rate as given: a schedule, or the variable holding a float
    (`optimizer.learning_rate` evaluates a schedule): `_learning_rate`."""
    return optimizer._learning_rate


def iterations_variable(optimizer: keras.optimizers.Optimizer) -> keras.Variable:
    """The variable behind `optimizer.iterations`, to assign to: `_iterations`."""
    return optimizer._iterations


def optimizer_variables_list(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The model variables an optimizer was built for, in slot order:
    `_trainable_variables`."""
    return optimizer._trainable_variables


def variable_index(optimizer: keras.optimizers.Optimizer, variable: Any) -> int:
    """The position of a model variable in the optimizer's slot lists:
    `_get_variable_index`."""
    return optimizer._get_variable_index(variable)


def weight_decay_exclusions(optimizer: keras.optimizers.Optimizer) -> tuple[Any, Any]:
    """What `exclude_from_weight_decay` recorded: (variable keys, compiled name pattern):
    `_exclude_from_weight_decay`, `_exclude_from_weight_decay_pattern`."""
    return (
        getattr(optimizer, "_exclude_from_weight_decay", None),
        getattr(optimizer, "_exclude_from_weight_decay_pattern", None),
    )


APPLY_WEIGHT_DECAY = "_apply_weight_decay"  # the optimizer method that decays all variables


def apply_weight_decay(optimizer: keras.optimizers.Optimizer) -> Callable[[list[Any]], Any]:
    """The bound method that applies weight decay to a list of variables (placement runs
    it per device by setting an instance attribute of this name): `_apply_weight_decay`."""
    return getattr(optimizer, APPLY_WEIGHT_DECAY)


def optimizer_strategy(optimizer: Any) -> Any:
    """The `tf.distribute` strategy a TensorFlow-backend optimizer was created under, or
    None: `_distribution_strategy`."""
    return getattr(optimizer, "_distribution_strategy", None)


# ---------------------------------------------------------------- Keras: callbacks, metrics


def metric_direction(metric: Any) -> str | None:
    """`"up"` or `"down"`: which way a Keras metric improves, or None: `_direction`."""
    return getattr(metric, "_direction", None)


def reset_monitor_op(callback: Any) -> bool:
    """Makes `EarlyStopping`/`ModelCheckpoint`/`ReduceLROnPlateau` choose their comparison
    again from `mode` and the model's metrics: `_set_monitor_op`. False when the callback
    has no such method."""
    method = getattr(callback, "_set_monitor_op", None)
    if method is None:
        return False
    method()
    return True


def set_callback_model(callback: keras.callbacks.Callback, model: Any) -> None:
    """Points a callback at `model` without its `set_model` (`TensorBoard`'s opens new
    writers and writes the graph): `_model`, which `Callback.model` returns."""
    callback._model = model


def backup_weights_path(callback: keras.callbacks.BackupAndRestore) -> str:
    """The weights file `BackupAndRestore` writes: `_weights_path`."""
    return callback._weights_path


def log_weights(callback: keras.callbacks.TensorBoard, epoch: int) -> None:
    """Writes the model's weight histograms (and images) for `epoch`: `TensorBoard._log_weights`
    (`callback` may be a `super()` of a subclass that overrides it)."""
    callback._log_weights(epoch)


def tensorboard_profile_batch(callback: keras.callbacks.TensorBoard) -> int:
    """The first batch a `TensorBoard` callback profiles, 0 when it profiles none:
    `_start_batch`."""
    return callback._start_batch


# ---------------------------------------------------------------- TensorFlow: tf.distribute


def in_multi_worker_mode(strategy: Any) -> bool:
    """Whether a strategy spans several workers: `extended._in_multi_worker_mode()`."""
    return bool(strategy.extended._in_multi_worker_mode())


def strategy_supports_no_merge_call() -> bool:
    """Whether the current strategy updates without a merge call:
    `tf.__internal__.distribute.strategy_supports_no_merge_call`."""
    import tensorflow as tf

    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def maybe_merge_call(fn: Callable[..., Any], strategy: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs `fn(strategy, *args)` in a cross-replica merge call when the strategy needs one:
    `tf.__internal__.distribute.interim.maybe_merge_call`."""
    import tensorflow as tf

    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args, **kwargs)


# ---------------------------------------------------------------- KerasTuner


def _kt(module: str) -> ModuleType:
    return importlib.import_module(f"keras_tuner.src.{module}")


def kt_trial_module() -> ModuleType:
    """KerasTuner's trial module (`Trial`, `TrialStatus`): `keras_tuner.src.engine.trial`."""
    return _kt("engine.trial")


def kt_debug() -> bool:
    """Whether KerasTuner runs in debug mode (re-raise trial errors):
    `keras_tuner.src.config.DEBUG`."""
    return bool(_kt("config").DEBUG)


def kt_load_json(path: str) -> Any:
    """Reads a JSON file as KerasTuner does: `keras_tuner.src.utils.load_json`."""
    return _kt("utils").load_json(path)


def kt_save_json(path: str, obj: Any) -> Any:
    """Writes a JSON file as KerasTuner does: `keras_tuner.src.utils.save_json`."""
    return _kt("utils").save_json(path, obj)


def kt_build_hypermodel(tuner: Any, hp: Any) -> keras.Model:
    """A trial's model, built by the tuner's hypermodel: `Tuner._build_hypermodel` (`tuner`
    may be a `super()` of a subclass that overrides it)."""
    return tuner._build_hypermodel(hp)


def model_size(model: keras.Model) -> Any:
    """The parameter count KerasTuner checks against `max_model_size`:
    `keras_tuner.src.engine.tuner.maybe_compute_model_size`."""
    return _kt("engine.tuner").maybe_compute_model_size(model)


def validate_trial_results(results: Any, objective: Any, where: str) -> None:
    """KerasTuner's check of what `run_trial` returned:
    `keras_tuner.src.engine.tuner_utils.validate_trial_results`."""
    _kt("engine.tuner_utils").validate_trial_results(results, objective, where)


def metrics_dict(results: Any, objective: Any) -> dict[str, Any]:
    """What `run_trial` returned as a dict of metric values:
    `keras_tuner.src.engine.tuner_utils.convert_to_metrics_dict`."""
    return _kt("engine.tuner_utils").convert_to_metrics_dict(results, objective)


def best_step(results: Any, objective: Any) -> int:
    """The step (epoch) of the best objective value in what `run_trial` returned:
    `keras_tuner.src.engine.tuner_utils.get_best_step`."""
    return _kt("engine.tuner_utils").get_best_step(results, objective)


def release_oracle_lock(oracle: Any, thread_name: str) -> bool:
    """Releases the lock KerasTuner's `@synchronized` holds on `oracle` when thread
    `thread_name` holds it (it is never released when the wrapped method raises); returns
    whether it did: `keras_tuner.src.engine.oracle.LOCKS`, `THREADS`."""
    kt_oracle = _kt("engine.oracle")
    if kt_oracle.THREADS.get(oracle) != thread_name:
        return False
    kt_oracle.THREADS[oracle] = None
    kt_oracle.LOCKS[oracle].release()
    return True


def retry_queue(oracle: Any) -> list[str]:
    """Ids of the trials the oracle will hand out again: `_retry_queue`."""
    return oracle._retry_queue


def set_retry_queue(oracle: Any, trial_ids: list[str]) -> None:
    """Replaces the oracle's retry queue: `_retry_queue`."""
    oracle._retry_queue = trial_ids


def run_times(oracle: Any) -> dict[str, int]:
    """How many times each trial was run, by id: `_run_times`."""
    return oracle._run_times


def oracle_project_dir(oracle: Any) -> str:
    """The oracle's project folder: `_project_dir`."""
    return oracle._project_dir


def set_oracle_project_dir(oracle: Any, directory: str, project_name: str) -> None:
    """Points the oracle at a project folder: `_set_project_dir`."""
    oracle._set_project_dir(directory, project_name)


def oracle_file(oracle: Any) -> str:
    """The path of `oracle.json`: `_get_oracle_fname`."""
    return oracle._get_oracle_fname()


def trial_dir(oracle: Any, trial_id: str) -> str:
    """A trial's folder: `_get_trial_dir`."""
    return oracle._get_trial_dir(trial_id)


def random_unseen_values(oracle: Any) -> dict | None:
    """Values of the oracle's space drawn at random, none it handed out before (`None`:
    the space is exhausted): `_random_values`."""
    return oracle._random_values()


def replace_save_trial(oracle: Any, save: Callable[[Any], None]) -> None:
    """Makes the oracle write `trial.json` files with `save(trial)`: `_save_trial`."""
    oracle._save_trial = save


def is_worker(tuner: Any) -> bool:
    """Whether this tuner is a worker of a distributed search: `_is_worker`."""
    return bool(tuner._is_worker())


def tuner_file(tuner: Any) -> str:
    """The path of the tuner's state file: `_get_tuner_fname`."""
    return tuner._get_tuner_fname()


def checkpoint_file(tuner: Any, trial_id: str) -> str:
    """The weights file of a trial: `_get_checkpoint_fname`."""
    return tuner._get_checkpoint_fname(trial_id)


def build_config_file(tuner: Any, trial_id: str) -> str:
    """The build-config file of a trial: `_get_build_config_fname`."""
    return tuner._get_build_config_fname(trial_id)


def copy_callbacks(tuner: Any, callbacks: list[Any]) -> list[Any]:
    """Deep copies of the search's callbacks for one trial: `_deepcopy_callbacks`."""
    return tuner._deepcopy_callbacks(callbacks)


def configure_tensorboard_dir(
    tuner: Any, callbacks: list[Any], trial: Any, execution: int = 0
) -> None:
    """Points `TensorBoard` callbacks at one execution's log folder of a trial:
    `_configure_tensorboard_dir(callbacks, trial, execution)`."""
    tuner._configure_tensorboard_dir(callbacks, trial, execution)


def run_and_update_trial(tuner: Any, trial: Any, *fit_args: Any, **fit_kwargs: Any) -> None:
    """Runs one trial as `search` does, recording its result or failure:
    `_try_run_and_update_trial`."""
    tuner._try_run_and_update_trial(trial, *fit_args, **fit_kwargs)


def kt_protos() -> ModuleType:
    """KerasTuner's gRPC messages and service: `keras_tuner.src.protos`."""
    return _kt("protos")


def oracle_servicer_class() -> type:
    """The chief's gRPC servicer: `keras_tuner.src.distribute.oracle_chief.OracleServicer`."""
    return _kt("distribute.oracle_chief").OracleServicer


def is_chief_oracle() -> bool:
    """Whether this process is the chief of a distributed search (`KERASTUNER_TUNER_ID`):
    `keras_tuner.src.distribute.utils.is_chief_oracle`."""
    return bool(_kt("distribute.utils").is_chief_oracle())


def has_chief_oracle() -> bool:
    """Whether this process belongs to a distributed search (the chief's address is set):
    `keras_tuner.src.distribute.utils.has_chief_oracle`."""
    return bool(_kt("distribute.utils").has_chief_oracle())
