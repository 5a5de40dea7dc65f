"""`ModelPack`'s loop backroom: what runs around and inside Keras's `fit`, `evaluate` and
`predict` loops for a pack.

Its modules, each read by `model.py` through the names below:

- `_fit_args`: what the pack does with the loops' arguments before Keras's (checks, the
  callbacks it adds, batches per call).
- `_batch_calls`: how many batches a call runs, and how a call of several batches runs.
- `_device_loop` (JAX), `_tf_steps` (TensorFlow): the backend's steps.
- `_logs`: the step's stacked logs and the `m{i}_...` figures made from them.
- `_progress`, `_watcher`, `_member_callbacks`, `_early_stopping`, `_pack_internals`: the
  callbacks a pack's `fit` runs, and what of the pack they read.
- `_gc_freeze`: the first steps traced with Python's collector sparing older objects.
- `collective_clash_explained` (of `pack/_replicas.py`, which the engines read too): a
  `fit` under a `tf.distribute` strategy raising TensorFlow's clash of two strategies'
  all-reduces with its cause.

It never imports `model.py`, nor the compiling or member backrooms (`_compiling`,
`_member_access`).
"""

from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack._loop._batch_calls import device_loop, keeping_failed_steps
from keras_gpushare.pack._loop._fit_args import (
    Items,
    call_arguments,
    check_inputs,
    check_labels,
    check_shardable,
    evaluate_values,
    fit_callbacks,
    fit_step_counts,
    stacked_predictions,
    steps_for,
    with_progress_bar,
)
from keras_gpushare.pack._loop._gc_freeze import OldObjectsFrozen
from keras_gpushare.pack._loop._logs import expanded, expanding, step_logs
from keras_gpushare.pack._replicas import collective_clash_explained

if BACKEND.own_steps:
    # The pack's steps on TensorFlow, as Keras mixes in its `TensorFlowTrainer`.
    from keras_gpushare.pack._loop._tf_steps import TensorFlowSteps

    BACKEND_STEPS: tuple[type, ...] = (TensorFlowSteps,)
else:
    BACKEND_STEPS = ()

__all__ = [
    "BACKEND_STEPS",
    "Items",
    "OldObjectsFrozen",
    "call_arguments",
    "check_inputs",
    "check_labels",
    "check_shardable",
    "collective_clash_explained",
    "device_loop",
    "evaluate_values",
    "expanded",
    "expanding",
    "fit_callbacks",
    "fit_step_counts",
    "keeping_failed_steps",
    "stacked_predictions",
    "step_logs",
    "steps_for",
    "with_progress_bar",
]
