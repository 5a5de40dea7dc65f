"""Many batches in one compiled call on JAX: a loop on the device, not in Python.

Keras-JAX runs `steps_per_execution` batches a call as a Python loop of one-batch jitted
calls (`JAXTrainer._make_function`): every batch pays a dispatch from Python, which on a
GPU is most of what a small pack's step costs. A pack's training and test functions instead
stack the call's batches and run them through one jitted `lax.fori_loop` over the step, so a
call of 64 batches is one dispatch. The step is Keras's own (`train_step`/`test_step`),
traced once: the loop's body calls the same jitted one-batch step that also runs a batch of
another shape (the short last batch of an epoch), so a `fit` compiles two programs, as
Keras's loop does.

What a call does is what Keras's loop does, batch for batch: the same steps in the same
order, the last batch's logs returned. Batches are stacked up to `steps_per_execution`
(a call with fewer, at the end of an epoch, runs the same program with fewer iterations);
consecutive batches of one shape go through the loop, a batch of a shape of its own through
the one-batch step. Where the data raises after the call's first batch, the batches before
it are trained and their state kept before the error reaches the user (as
`_batch_calls.keeping_failed_steps` keeps it for Keras's loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np
from jax import numpy as jnp

from keras_gpushare import _upstream

Step = Callable[[Any, Any], tuple[Any, Any]]


def applies(model: Any) -> bool:
    """Whether `model`'s calls of several batches can run as a device loop: JAX compiles
    its steps (`jit_compile`, not eager) and no Keras distribution lays out its data."""
    return (
        model.steps_per_execution > 1
        and model.jit_compile
        and not model.run_eagerly
        and keras.distribution.distribution() is None
    )


def function(model: Any, step: Step, keep_failed: bool) -> Callable[[Any, Any], Any]:
    """A training or test function for `model` (`(state, iterator) -> (logs, state)`, as
    Keras's) running each call's batches through one device loop of `step`.

    Args:
        model: the pack; its `steps_per_execution` bounds a call's batches.
        step: Keras's one-batch step (`model.train_step` or `model.test_step`).
        keep_failed: whether a call whose data raises after its first batch keeps the state
            its earlier batches reached (training: `fit` keeps it as plain `fit` does).
    """
    one = jax.jit(step, donate_argnums=0)
    loop = jax.jit(_looping(one), donate_argnums=0)
    size = int(model.steps_per_execution)

    def call(state: Any, iterator: Any) -> Any:
        batches, error = _take(iterator, size)
        logs = None
        for run in _runs(batches):
            if len(run) == 1:
                logs, state = one(state, run[0])
            else:
                logs, state = loop(state, _stacked(run, size), np.int32(len(run)))
        if error is not None:
            if keep_failed:
                _upstream.keep_jax_state(model, state)
            raise error
        return logs, state

    return call


def _looping(one: Step) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """The jitted loop: `count` steps of `one` over the first `count` stacked batches."""

    def loop(state: Any, batches: Any, count: Any) -> Any:
        first = jax.tree_util.tree_map(lambda b: b[0], batches)
        # `one`'s trace at these shapes is cached, so the body below reuses it.
        shapes = jax.eval_shape(one, state, first)[0]
        logs = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(index: Any, carried: Any) -> Any:
            state, _ = carried
            batch = jax.tree_util.tree_map(lambda b: b[index], batches)
            logs, state = one(state, batch)
            return state, logs

        state, logs = jax.lax.fori_loop(0, count, body, (state, logs))
        return logs, state

    return loop


def _take(iterator: Any, size: int) -> tuple[list, Exception | None]:
    """Up to `size` batches of `iterator`, and the error that ended them early, if any.
    An error (or the end of the data) at the first batch is raised, as Keras's call
    raises it."""
    batches = [next(iterator)]
    try:
        while len(batches) < size:
            batches.append(next(iterator))
    except StopIteration:
        pass
    except Exception as error:  # raised after the batches before it are trained
        return batches, error
    return batches, None


def _signature(batch: Any) -> tuple:
    leaves, structure = jax.tree_util.tree_flatten(batch)
    return structure, tuple((np.shape(leaf), np.result_type(leaf)) for leaf in leaves)


def _runs(batches: list) -> list[list]:
    """`batches` cut where their shapes change, in order."""
    runs: list[list] = []
    previous = None
    for batch in batches:
        signature = _signature(batch)
        if runs and signature == previous:
            runs[-1].append(batch)
        else:
            runs.append([batch])
        previous = signature
    return runs


def _stacked(run: list, size: int) -> Any:
    """The batches of `run` stacked on a new leading axis of `size` (the last one repeated
    where the run is shorter: the loop stops before them), so one program serves every
    call."""
    padded = run + [run[-1]] * (size - len(run))

    def stack(*leaves: Any) -> Any:
        if all(isinstance(leaf, np.ndarray) for leaf in leaves):
            return np.stack(leaves)
        return jnp.stack(leaves)

    return jax.tree_util.tree_map(stack, *padded)
