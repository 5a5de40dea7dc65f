"""How many batches a pack compiled with `steps_per_execution="auto"` runs per call.

Such a pack runs many batches per compiled call, as fast as Keras can. Two things a plain
`fit` (Keras's default of one batch per call) does must stay as they are:

- Keras calls batch hooks once per call, not once per batch: a `fit` given a callback that
  acts on batches runs one batch per call.
- Keras's loop runs whole calls: with `steps_per_epoch=10` and 64 batches a call it would
  take 64 optimizer steps an epoch (or all the data has). Where the user counts the steps
  (`steps_per_epoch`, `validation_steps`, `steps`), a call runs a number of batches that
  divides each count, so an epoch is exactly the steps asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import keras

from keras_gpushare import _upstream

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
    does, on the instance)."""
    if name in vars(callback):
        return True
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
