"""One trial inside a pack: its logs, checkpoint, callbacks and stopping, as if it ran alone."""

from __future__ import annotations

import logging
import os
from typing import Any

import keras
from keras_tuner.src.engine import trial as trial_module

from keras_gpushare.tuner import _state

logger = logging.getLogger("keras_gpushare.tuner")


def member_logs(logs: dict | None, index: int) -> dict:
    """Member `index`'s figures under single-model names: `val_m2_loss` -> `val_loss`."""
    prefix, val_prefix = f"m{index}_", f"val_m{index}_"
    result = {}
    for key, value in (logs or {}).items():
        if key.startswith(prefix):
            result[key[len(prefix) :]] = value
        elif key.startswith(val_prefix):
            result["val_" + key[len(val_prefix) :]] = value
    return result


class TrialRun:
    """What one trial needs while it trains as member `index` of a pack.

    Args:
        tuner: the `ParallelTuner`.
        trial: the trial.
        model: the trial's compiled model (becomes the pack member).
        callbacks: the trial's own copies of the search's callbacks.
        last_epoch: the epoch count after which the trial stops (Hyperband budgets).
    """

    def __init__(
        self,
        tuner: Any,
        trial: trial_module.Trial,
        model: keras.Model,
        callbacks: list[keras.callbacks.Callback],
        last_epoch: int,
    ) -> None:
        self.tuner = tuner
        self.trial = trial
        self.model = model
        self.callbacks = callbacks
        self.last_epoch = last_epoch
        self.index = -1
        self.active = True
        self.diverged_epoch: int | None = None
        self.epochs: list[int] = []
        self.history: dict[str, list[float]] = {}
        objective = tuner.oracle.objective
        self._objective = objective
        self._best = float("-inf") if objective.direction == "max" else float("inf")
        self._checkpoint = tuner._get_checkpoint_fname(trial.trial_id)

    def record(self, epoch: int, logs: dict) -> None:
        self.epochs.append(epoch)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(float(value))

    def checkpoint(self, logs: dict) -> None:
        """Saves the member's weights when the objective improved (KerasTuner's rule)."""
        if self._objective.has_value(logs):
            value = self._objective.get_value(logs)
            if not self._objective.better_than(value, self._best):
                return
            self._best = value
        _state.save_weights(self.model, self._checkpoint)

    def results(self) -> keras.callbacks.History:
        """The trial's history, as `model.fit` would have returned it."""
        history = keras.callbacks.History()
        history.history = dict(self.history)
        history.epoch = list(self.epochs)
        history.set_model(self.model)
        return history

    def clear_checkpoint(self) -> None:
        if os.path.exists(self._checkpoint):
            os.remove(self._checkpoint)


class PackTrials(keras.callbacks.Callback):
    """Dispatches the pack's `fit` events to each trial, under single-model log names.

    Each trial's callbacks see their own member as `self.model` and their own figures
    (`val_loss`, not `val_m2_loss`); a callback that sets `model.stop_training` stops only
    that member. Batch-level events are not forwarded (so `fit` keeps Keras's asynchronous
    dispatch); epoch and train events are.

    Args:
        pack: the `ModelPack` being trained.
        runs: one `TrialRun` per member, in member order.
        epochs: the `epochs` argument of the pack's `fit`.
    """

    def __init__(self, pack: keras.Model, runs: list[TrialRun], epochs: int) -> None:
        super().__init__()
        self._pack = pack
        self._runs = runs
        self._epochs = epochs
        for index, run in enumerate(runs):
            run.index = index

    def on_train_begin(self, logs: dict | None = None) -> None:
        for run in self._runs:
            run.model.stop_training = False
            for callback in run.callbacks:
                callback.set_model(run.model)
                callback.set_params(dict(self.params or {}))
                callback.on_train_begin(member_logs(logs, run.index))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        for run in self._runs:
            if run.active:
                mlogs = member_logs(logs, run.index)
                run.tuner.on_epoch_begin(run.trial, run.model, epoch, logs=mlogs)
                for callback in run.callbacks:
                    callback.on_epoch_begin(epoch, mlogs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Reading `members` refreshes the fused engine's member models from its stacked
        # weights, so checkpoints and callbacks see this epoch's weights.
        members = self._pack.members
        status = self._pack.status
        for run in self._runs:
            if not run.active:
                continue
            run.model = members[run.index]
            mlogs = member_logs(logs, run.index)
            run.record(epoch, mlogs)
            if status[run.index] == "frozen:nan":
                run.active = False
                run.diverged_epoch = epoch
                continue
            run.checkpoint(mlogs)
            run.tuner.on_epoch_end(run.trial, run.model, epoch, logs=mlogs)
            for callback in run.callbacks:
                callback.on_epoch_end(epoch, mlogs)
            if run.model.stop_training or epoch + 1 >= run.last_epoch:
                run.active = False
                if epoch + 1 < self._epochs:
                    self._pack.stop_member(run.index)
        if not any(run.active for run in self._runs) and epoch + 1 < self._epochs:
            self._pack.stop_training = True

    def on_train_end(self, logs: dict | None = None) -> None:
        for run in self._runs:
            mlogs = {k: v[-1] for k, v in run.history.items()}
            for callback in run.callbacks:
                callback.on_train_end(mlogs)
