"""One trial execution inside a pack: its logs, checkpoint and callbacks, as if it ran alone."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack.program import member_logs
from keras_gpushare.tuner import _own_files, _state
from keras_gpushare.tuner._executor import TrialCalls

if TYPE_CHECKING:
    from keras_tuner.engine.trial import Trial


trial_module = _upstream.kt_trial_module()


def implements_batch_hooks(callbacks: list[keras.callbacks.Callback]) -> bool:
    """Whether a callback overrides a train-batch hook (which turns per-batch calls on)."""
    base = keras.callbacks.Callback
    names = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")
    return any(
        getattr(type(c), name) is not getattr(base, name) for c in callbacks for name in names
    )


class BestCheckpoint:
    """KerasTuner's `SaveBestEpoch` for one trial, shared by all its executions.

    Keeps a model's weights when the objective improved on the best value seen in any
    execution of the trial, or on every epoch when the logs do not hold the objective, and
    writes the kept weights to the trial's checkpoint file once the trial's pack has
    trained (`write`): the file ends as KerasTuner's would, without a file written per
    trial and epoch. A pack that raises writes nothing (`clear`).

    Args:
        objective: the oracle's `keras_tuner.Objective`.
        path: the trial's checkpoint file.
    """

    def __init__(self, objective: Any, path: str) -> None:
        self.objective = objective
        self.path = path
        self.best = float("-inf") if objective.direction == "max" else float("inf")
        self._kept: tuple[keras.Model, list] | None = None

    def update(self, model: keras.Model, logs: dict) -> None:
        if self.objective.has_value(logs):
            value = self.objective.get_value(logs)
            if not self.objective.better_than(value, self.best):
                return
            self.best = value
        self._kept = (model, model.get_weights())

    def write(self) -> None:
        """Writes the kept weights to the checkpoint file (nothing when none were kept)."""
        if self._kept is None:
            return
        model, weights = self._kept
        self._kept = None
        current = model.get_weights()
        model.set_weights(weights)
        try:
            _state.save_weights(model, self.path)
        finally:
            model.set_weights(current)

    def clear(self) -> None:
        self._kept = None
        if os.path.exists(self.path):
            os.remove(self.path)


class TrialRun:
    """One execution of a trial while it trains as member `index` of a pack.

    Args:
        calls: the `TrialCalls` the tuner handed its executor (its hooks run per epoch).
        trial: the trial.
        execution: the execution's number within the trial (0 for the first).
        model: the execution's compiled model (becomes the pack member).
        callbacks: the execution's own copies of the search's callbacks (a `CSVLogger`
            among them writes a file of its own until the execution ends: `_own_files`).
        last_epoch: the epoch count after which the trial stops (Hyperband budgets).
        checkpoint: the trial's `BestCheckpoint`, shared by its executions.
        build_state: what its build left of the random generators (a
            `_data_orders.BuildState`), None when not known.
    """

    def __init__(
        self,
        calls: TrialCalls,
        trial: Trial,
        execution: int,
        model: keras.Model,
        callbacks: list[keras.callbacks.Callback],
        last_epoch: int,
        checkpoint: BestCheckpoint,
        build_state: Any = None,
    ) -> None:
        self.calls = calls
        self.trial = trial
        self.execution = execution
        self.model = model
        self.callbacks = callbacks
        self._own_files = _own_files.redirect(callbacks, trial.trial_id, execution)
        self.last_epoch = last_epoch
        self.checkpoint = checkpoint
        self.build_state = build_state
        self.index = -1
        self.active = True
        # The epoch this execution trains next (a program's epochs are not its own: a slot
        # refilled mid-fit starts at its trial's first epoch).
        self.next_epoch = 0
        self.epochs: list[int] = []
        self.history: dict[str, list[float]] = {}

    def begin_epoch(self, epoch: int, logs: dict | None) -> None:
        """Epoch `epoch` begins: the tuner's hook and the callbacks see this member's logs."""
        mlogs = member_logs(logs, self.index)
        self.calls.on_epoch_begin(self.trial, self.model, epoch, logs=mlogs)
        for callback in self.callbacks:
            callback.on_epoch_begin(epoch, mlogs)

    def end_epoch(self, epoch: int, logs: dict | None, model: keras.Model) -> None:
        """Epoch `epoch` ended, `model` holding its weights: recorded, checkpointed, and the
        tuner's hook and the callbacks see this member's logs."""
        self.model = model
        mlogs = member_logs(logs, self.index)
        self.record(epoch, mlogs)
        self.checkpoint.update(self.model, mlogs)
        self.calls.on_epoch_end(self.trial, self.model, epoch, logs=mlogs)
        for callback in self.callbacks:
            callback.on_epoch_end(epoch, mlogs)

    def begin_batch(self, batch: int, logs: dict | None) -> None:
        """A train batch begins: the tuner's hook and the callbacks see this member's logs."""
        mlogs = member_logs(logs, self.index)
        self.calls.on_batch_begin(self.trial, self.model, batch, mlogs)
        for callback in self.callbacks:
            callback.on_train_batch_begin(batch, mlogs)

    def end_batch(self, batch: int, logs: dict | None) -> None:
        """A train batch ended: the tuner's hook and the callbacks see this member's logs."""
        mlogs = member_logs(logs, self.index)
        self.calls.on_batch_end(self.trial, self.model, batch, mlogs)
        for callback in self.callbacks:
            callback.on_train_batch_end(batch, mlogs)

    def end(self) -> None:
        """The execution ended: its callbacks see `on_train_end` with its last figures, and
        the files they wrote take the user's paths."""
        logs = {k: v[-1] for k, v in self.history.items()}
        for callback in self.callbacks:
            callback.on_train_end(logs)
        for own_file in self._own_files:
            own_file.settle()

    def abandon(self) -> None:
        """The execution will train again elsewhere (alone): its checkpoint and the files
        its callbacks wrote are dropped."""
        self.checkpoint.clear()
        _own_files.discard(self._own_files)

    def record(self, epoch: int, logs: dict) -> None:
        self.epochs.append(epoch)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(float(value))

    def results(self) -> keras.callbacks.History:
        """The execution's history, as `model.fit` would have returned it."""
        history = keras.callbacks.History()
        history.history = dict(self.history)
        history.epoch = list(self.epochs)
        history.set_model(self.model)
        return history
