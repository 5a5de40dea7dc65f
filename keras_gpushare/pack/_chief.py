"""What a pack writes under `MultiWorkerMirroredStrategy`: files once, by the chief.

Every worker runs the same script, so every worker calls `pack.save(...)`, and Keras's
`ModelCheckpoint` and `BackupAndRestore` save on every worker. All workers must take part
(reading variables may all-reduce across workers), but only the chief's file may land at the
path, and only whole: the other workers write into a temporary directory that is removed at
once, and the chief writes under a temporary name that is renamed when complete. A
non-chief worker's `BackupAndRestore` reads the chief's backup when it starts but never
writes or deletes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND


def writes_files(model: keras.Model) -> bool:
    """Whether this worker is the one that writes `model`'s files (True without a cluster)."""
    if not BACKEND.distribute_strategies:
        return True
    return bool(model.distribute_strategy.extended.should_checkpoint)


@contextlib.contextmanager
def chief_path(model: keras.Model, filepath: Any, whole: bool = True) -> Iterator[Any]:
    """Where to write `filepath`: the chief's file lands whole, the others' nowhere.

    On the chief (and without a cluster) a local file is written next to its place under a
    temporary name and moved there when complete, so a reader (a restarted worker, another
    process) never sees half a file (`whole=False` writes in place: sharded weights are
    several files). Elsewhere the path lies in a directory removed afterwards.
    """
    target = os.fspath(filepath)
    if not writes_files(model):
        directory = tempfile.mkdtemp(prefix="keras_gpushare_worker_")
        try:
            yield os.path.join(directory, os.path.basename(target))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    if not whole or "://" in target:
        yield filepath
        return
    folder, name = os.path.split(os.path.abspath(target))
    partial = os.path.join(folder, f".partial-{os.getpid()}-{name}")
    try:
        yield partial
        if os.path.exists(partial):
            os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


class _ReadOnlyBackup(keras.callbacks.BackupAndRestore):
    """A non-chief worker's `BackupAndRestore`: restores the chief's backup, never writes it."""

    def _save_model(self) -> None:
        # Take part in the save (reading variables may all-reduce); the file goes nowhere.
        self.model.save_weights(_upstream.backup_weights_path(self), overwrite=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        return None


def chief_callbacks(model: keras.Model, callbacks: list) -> list:
    """`callbacks` with each `BackupAndRestore` made read-only on a non-chief worker."""
    if writes_files(model):
        return callbacks
    result = []
    for callback in callbacks:
        if type(callback) is keras.callbacks.BackupAndRestore:
            copy = _ReadOnlyBackup.__new__(_ReadOnlyBackup)
            copy.__dict__.update(callback.__dict__)
            callback = copy
        result.append(callback)
    return result
