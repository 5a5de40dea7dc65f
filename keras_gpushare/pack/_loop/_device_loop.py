"""Many batches in one compiled call on JAX: a loop on the device, not in Python.

Keras-JAX runs `steps_per_execution` batches a call as a Python loop of one-batch jitted
calls (`JAXTrainer._make_function`): every batch pays a dispatch from Python, which on a
GPU is most of what a small pack's step costs. A pack's training and test functions instead
stack the call's batches and run them through one jitted `lax.fori_loop` over the step, so a
call of 64 batches is one dispatch. The step is Keras's own (`train_step`/`test_step`),
traced once: the loop's body calls the same jitted one-batch step that also runs a batch of
another shape (the short last batch of an epoch), so a `fit` compiles two programs, as
Keras's loop does.

The short last batch runs once an epoch, yet its program cost as much to compile as the
loop's (about 1 s of a short `fit`'s 2.8 s for 8 small MLPs on a 2-core CPU). So on a CPU a
batch that has only ever run alone at the end of a call (a shape of its own, last of its
call's batches) is compiled with LLVM's cheapest optimization level: half the compile time,
a slower run of that one batch, the same computation to rounding (XLA's optimizations of
the computation are the same; only the machine code differs). A shape that also runs
elsewhere in a call (batches of varying shapes) is compiled as the loop's body is. (JAX
0.4.36 or later: an older JAX takes no compiler options, and compiles it as the body.)

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

# How the last batch of an epoch is compiled on a CPU: LLVM's cheapest level (XLA's default
# is 2). A key of XLA's `DebugOptions`; a release without it fails this module's test.
LAST_BATCH_OPTIONS = {"xla_backend_optimization_level": 0}


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
    last = _last_batch_step(step, one)
    size = int(model.steps_per_execution)
    # Signatures of batches that ran other than alone at the end of a call.
    regular: set[tuple] = set()

    def call(state: Any, iterator: Any) -> Any:
        batches, error = _take(iterator, size)
        runs = _runs(batches)
        regular.update(
            signature
            for index, (signature, run) in enumerate(runs)
            if len(run) > 1 or index < len(runs) - 1
        )
        logs = None
        for signature, run in runs:
            if len(run) > 1:
                logs, state = loop(state, _stacked(run, size), np.int32(len(run)))
            elif signature in regular:
                logs, state = one(state, run[0])
            else:
                logs, state = last(state, run[0])
        if error is not None:
            if keep_failed:
                _upstream.keep_jax_state(model, state)
            raise error
        return logs, state

    return call


def _last_batch_step(step: Step, one: Step) -> Step:
    """`step` jitted for a batch that runs alone at the end of its calls: on a CPU compiled
    with `LAST_BATCH_OPTIONS` (named `last_batch` in JAX's compile log), elsewhere `one`,
    as on a JAX before 0.4.36, which takes no compiler options."""
    if jax.default_backend() != "cpu":
        return one

    def last_batch(state: Any, batch: Any) -> Any:
        return step(state, batch)

    try:
        return jax.jit(last_batch, donate_argnums=0, compiler_options=LAST_BATCH_OPTIONS)
    except TypeError:
        return one


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


def _runs(batches: list) -> list[tuple[tuple, list]]:
    """`batches` cut where their shapes change, in order, each run with its signature."""
    runs: list[tuple[tuple, list]] = []
    for batch in batches:
        signature = _signature(batch)
        if runs and signature == runs[-1][0]:
            runs[-1][1].append(batch)
        else:
            runs.append((signature, [batch]))
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
