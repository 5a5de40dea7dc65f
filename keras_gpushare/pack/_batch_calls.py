"""Which callbacks need Keras to call them after every batch.

A pack compiled with `steps_per_execution="auto"` runs many batches per compiled call, as
fast as Keras can; Keras then calls batch hooks once per call, not once per batch. A plain
`fit` (Keras's default of one batch per call) calls them every batch, so a pack whose `fit`
is given a callback that acts on batches runs one batch per call too.
"""

from __future__ import annotations

from collections.abc import Iterable

import keras

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
    keras.callbacks.TensorBoard: lambda c: c.update_freq == "epoch" and not c._start_batch,
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
