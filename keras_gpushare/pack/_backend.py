"""What differs between Keras's backends for a pack: the one place of `pack/` that asks.

Keras keeps what differs per backend under `backend/<name>/` and picks its trainer mixin
once, when `keras.Model` is defined. A pack does the same through `BACKEND`, the
`BackendPolicy` of the running backend, chosen once at import: every module of `pack/`
asks it a named question (is there a graph engine, does a `tf.distribute` strategy apply,
does a failed step count) instead of comparing backend names. Only this module reads
`keras.backend.backend()` (a test of the package's structure checks that).

Nothing here imports TensorFlow: the answers are names and booleans, and the one that asks
TensorFlow about its devices imports it only on that backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np

from keras_gpushare import _upstream


@dataclasses.dataclass(frozen=True)
class BackendPolicy:
    """How a pack trains on one Keras backend: the answers that differ between backends.

    Attributes:
        name: Keras's name of the backend, for messages that name it.
        own_steps: whether the pack mixes its own train and test steps into `ModelPack`
            (`_tf_steps.TensorFlowSteps`), as Keras mixes its backend's trainer into
            `keras.Model`.
        graph_engine: whether the graph engine (members stepped by their own optimizers
            inside the pack's traced step) can train members; without it every member
            fuses.
        distribute_strategies: whether a `tf.distribute` strategy can hold the pack
            (replica contexts, a chief worker, TensorFlow's collective errors).
        one_batch_per_call: whether Keras's trainer runs one batch per compiled call
            (`steps_per_execution` must be 1).
        jit: whether the pack's step can compile with `jit_compile`.
        xla_optional: whether steps also compile to graphs of the backend's own kernels
            without XLA, so that on a CPU XLA must pay for its compile time and element-wise
            operations are not fused unless XLA compiles the step.
        stateless_steps: whether Keras's training function takes and returns the
            variables' values as state, so that a call of several batches that raises
            returns none of the state its earlier batches reached.
        failed_step_counted: whether Keras's one-batch step counts a step that raised in
            the optimizer's `iterations` (counted without waiting for the batch).
        label_ranges_checked: whether Keras's `fit` refuses sparse labels out of the
            output's range (elsewhere plain `fit` trains on them).
        sparse_embedding_gradients: whether an `Embedding` table gets a sparse gradient,
            to which Keras's optimizers apply their element-wise operations slice by slice.
        broadcast_batched_matmul: whether a batched matmul of one input against a stacked
            kernel reads the kernel as it lies (elsewhere the kernels are laid side by side
            for one plain matmul).
        split_in_one_op: whether one split of known sizes is one operation, where slices
            make several.
    """

    name: str
    own_steps: bool
    graph_engine: bool
    distribute_strategies: bool
    one_batch_per_call: bool
    jit: bool
    xla_optional: bool
    stateless_steps: bool
    failed_step_counted: bool
    label_ranges_checked: bool
    sparse_embedding_gradients: bool
    broadcast_batched_matmul: bool
    split_in_one_op: bool

    def tensorflow_gpu(self) -> bool:
        """Whether TensorFlow runs the steps and sees a GPU (`False` on other backends,
        where TensorFlow is not imported)."""
        return self.name == "tensorflow" and has_tensorflow_gpu()

    def fuses_elementwise(self) -> bool:
        """Whether the step being traced fuses element-wise operations into the ones they
        follow: under XLA, on a backend without plain graphs, or on an accelerator.
        TensorFlow's own kernels on a CPU fuse none."""
        return not self.xla_optional or has_accelerator() or _upstream.in_xla_context()

    def host_to_device(self, values: np.ndarray) -> Any:
        """`values` as a variable's initial value that no backend compiles a program for.

        On JAX, Keras turns a NumPy initial value into an array with `jnp.asarray`, which
        compiles a program (`stage`) per shape; a transfer (`jax.device_put`) compiles none.
        Elsewhere the NumPy array is returned as it is.

        Args:
            values: the values, on the host.

        Returns:
            An array holding `values`.
        """
        if self.name == "jax":
            import jax

            return jax.device_put(values)
        return values

    def host_values(self, *tensors: Any) -> list[np.ndarray] | None:
        """`tensors` as NumPy arrays where computing with them eagerly would compile programs
        that reading them does not: on JAX outside a trace (each eager operation of a new
        shape compiles one). `None` elsewhere, and while the step is traced.

        Args:
            *tensors: the backend's tensors.

        Returns:
            Their values on the host, or `None`.
        """
        if self.name != "jax":
            return None
        import jax

        if any(isinstance(t, jax.core.Tracer) for t in tensors):
            return None
        return [np.asarray(t) for t in tensors]


def policy_for(name: str) -> BackendPolicy:
    """The `BackendPolicy` of the Keras backend called `name`.

    Args:
        name: a Keras backend's name (`keras.backend.backend()`).

    Returns:
        Its answers. Another backend (`"numpy"`) gets JAX's, except `stateless_steps`.
    """
    tensorflow = name == "tensorflow"
    return BackendPolicy(
        name=name,
        own_steps=tensorflow,
        graph_engine=tensorflow,
        distribute_strategies=tensorflow,
        one_batch_per_call=name == "torch",
        jit=name != "torch",
        xla_optional=tensorflow,
        stateless_steps=name == "jax",
        failed_step_counted=tensorflow,
        label_ranges_checked=tensorflow,
        sparse_embedding_gradients=tensorflow,
        broadcast_batched_matmul=tensorflow,
        split_in_one_op=tensorflow,
    )


BACKEND = policy_for(keras.backend.backend())


def has_accelerator() -> bool:
    """Whether Keras sees a GPU or another accelerator (`False` when it cannot tell)."""
    try:
        devices = keras.distribution.list_devices()
    except (AttributeError, NotImplementedError, RuntimeError, ValueError):
        return False
    return any(not str(device).lower().startswith("cpu") for device in devices)


def has_tensorflow_gpu() -> bool:
    """Whether TensorFlow sees a GPU (call on the TensorFlow backend only)."""
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))
