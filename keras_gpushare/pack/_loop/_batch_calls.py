"""How many batches a pack compiled with `steps_per_execution="auto"` runs per call.

Such a pack runs many batches per compiled call, as fast as Keras can. Two things a plain
`fit` (Keras's default of one batch per call) does must stay as they are:

- Keras calls batch hooks once per call, not once per batch: a `fit` given a callback that
  acts on batches runs one batch per call.
- Keras's loop runs whole calls: with `steps_per_epoch=10` and 64 batches a call it would
  take 64 optimizer steps an epoch (or all the data has). Where the user counts the steps
  (`steps_per_epoch`, `validation_steps`, `steps`), a call runs a number of batches that
  divides each count, so an epoch is exactly the steps asked for.

And where the data raises in the middle of a call, the call leaves the members as plain
`fit` leaves them after the same batches (`keeping_failed_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND

_BATCH_HOOKS = (
    "on_batch_begin",
    "on_batch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)
# Keras callbacks whose batch hooks do nothing with these settings.
_EPOCH_ONLY = {
    keras.callbacks.ModelCheckpoint: lambda c: c.save_freq == "epoch",
    keras.callbacks.BackupAndRestore: lambda c: c.save_freq == "epoch",
    keras.callbacks.TensorBoard: lambda c: (
        c.update_freq == "epoch" and not _upstream.tensorboard_profile_batch(c)
    ),
    keras.callbacks.ProgbarLogger: lambda c: True,
}


def acts_on_batches(callback: keras.callbacks.Callback) -> bool:
    """Whether `callback` does something in a batch hook (so needs every batch)."""
    inner = getattr(callback, "callback", None)
    if isinstance(inner, keras.callbacks.Callback):
        return acts_on_batches(inner)
    for cls, epoch_only in _EPOCH_ONLY.items():
        if isinstance(callback, cls) and epoch_only(callback):
            return any(_overridden(callback, name, cls) for name in _BATCH_HOOKS)
    return any(_overridden(callback, name, keras.callbacks.Callback) for name in _BATCH_HOOKS)


def _overridden(callback: keras.callbacks.Callback, name: str, base: type) -> bool:
    """Whether `callback` replaces `base`'s hook `name` (in its class, or as `LambdaCallback`
    does, on the instance; an instance that puts `base`'s own hook back does not)."""
    own = vars(callback).get(name)
    if own is not None:
        return getattr(own, "__func__", None) is not getattr(base, name)
    return getattr(type(callback), name) is not getattr(base, name)


def any_act_on_batches(callbacks: Iterable[keras.callbacks.Callback]) -> bool:
    """Whether any of `callbacks` acts on batches."""
    return any(acts_on_batches(c) for c in callbacks)


def steps_per_call(
    limit: int, callbacks: Iterable[keras.callbacks.Callback], counts: Iterable[int | None]
) -> int:
    """Batches per compiled call: at most `limit`, 1 for batch callbacks, and a divisor of
    every step count the user gave (`None` or 0: left to the data, as Keras does)."""
    if any_act_on_batches(callbacks):
        return 1
    given = [int(c) for c in counts if c]
    if not given:
        return limit
    common = math.gcd(*given)
    return max(d for d in range(1, min(limit, common) + 1) if common % d == 0)


def keeping_failed_steps(model: keras.Model, function: Callable[..., Any]) -> Callable[..., Any]:
    """`model`'s training function, leaving a call whose data raises as plain `fit` would.

    Plain `fit` runs one batch per call. When the data raises (a generator or a
    `PyDataset` failing at batch k), every step before batch k is kept, and the error
    reaches the user. A pack running many batches per call keeps them too:

    - on JAX, Keras's loop of several batches a call would drop the state its earlier
      batches reached (the weights themselves in the first call of a `fit`); the call
      ends at the failing batch, its state is kept, then the error is raised;
    - on TensorFlow, Keras's one-batch step counts the failed step in the optimizer's
      `iterations` (the count is made without waiting for the batch), so each member
      whose own `fit` would run one batch a call counts it as well (`count_failed_step`).

    Args:
        model: the pack.
        function: the training function Keras made for it.

    Returns:
        The function to call in its place.
    """
    if BACKEND.stateless_steps and model.steps_per_execution > 1:
        return _jax_keeping_steps(model, function)
    if BACKEND.failed_step_counted:
        import tensorflow as tf

        from keras_gpushare.pack._loop import _tf_steps

        def train_function(iterator: Any) -> Any:
            try:
                return function(iterator)
            except tf.errors.OpError:
                _tf_steps.count_failed_step(model)
                raise

        return train_function
    return function


def device_loop(model: keras.Model, step: Any, keep_failed: bool) -> Any:
    """`_device_loop.function` for `model` where it applies (JAX), else `None`."""
    if not BACKEND.stateless_steps:
        return None
    from keras_gpushare.pack._loop import _device_loop  # imports JAX

    if not _device_loop.applies(model):
        return None
    return _device_loop.function(model, step, keep_failed)


def _jax_keeping_steps(model: keras.Model, function: Callable[..., Any]) -> Callable[..., Any]:
    def train_function(state: Any, iterator: Any) -> Any:
        batches = _UntilFailure(iterator)
        logs, state = function(state, batches)
        if batches.error is not None:
            _upstream.keep_jax_state(model, state)
            raise batches.error
        return logs, state

    return train_function


class _UntilFailure:
    """The batches of one call, ending (`StopIteration`) where the data raises after the
    call's first batch; the error is kept in `error`. An error at the first batch is raised
    at once, as Keras's one-batch call raises it."""

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator
        self._served = 0
        self.error: Exception | None = None

    def __iter__(self) -> _UntilFailure:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._iterator)
        except StopIteration:
            raise
        except Exception as error:
            if not self._served:
                raise
            self.error = error
            raise StopIteration from error
        self._served += 1
        return batch
