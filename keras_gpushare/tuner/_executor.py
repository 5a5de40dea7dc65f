"""The executor protocol of `ParallelTuner`: trials in, outcomes out.

An executor trains the trials the tuner hands it and says how each one ended; it never
sees the tuner. `ParallelTuner.__init__` builds one, once, from its `executor` argument
(the one place that reads it), and hands it plain values and callables:

- `TrialCalls`: what training a trial in this process needs from the tuner (building a
  trial's model, running a trial alone with KerasTuner's `run_trial`, copying the search's
  callbacks, checkpoint and build-config files, the tuner's per-epoch and per-batch hooks).
- `TrialFeed`, at each `run`: where the trials come from and where their outcomes go
  (`next_trials` asks the oracle for trials, one per slot; `end_trials` reports outcomes
  to the oracle and ends the trials as KerasTuner would; `one_at_a_time` runs them with
  KerasTuner's own loop instead).

The in-process executor is `_program_executor.ProgramExecutor`: trials in programs (compiled
packs with slots), kept and refilled (`executor="slots"`) or opened per round
(`executor="pack"`). Another executor takes one new module with an `Executor` subclass,
built from `TrialCalls` and the tuner's plain arguments, and one line in the choice
`ParallelTuner.__init__` makes (`ParallelTuner._make_executor`, plus the name in
`_check_arguments`): its `run(feed, fit_args, fit_kwargs)` asks `feed.next_trials(slots)`
for trials whenever slots are free and passes each ended trial's outcome to
`feed.end_trials`. The "processes" executor's `run` is the tuner's chief: it serves the
oracle to worker processes that run the trials (`_process_executor`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import keras

from keras_gpushare.tuner._search_ledger import SearchLedger


def error_line(error: BaseException) -> str:
    """`error`'s type and the first line of its message, at most 160 characters."""
    lines = str(error).strip().splitlines()
    text = type(error).__name__ + (f": {lines[0]}" if lines else "")
    return text if len(text) <= 160 else text[:157] + "..."


@dataclass
class TrialOutcome:
    """What `Tuner.run_trial` would have returned for a trial, or the error it raised.

    `path` says how the trial was trained (a record of `ParallelTuner.trial_paths`: plain
    strings under `"path"`, `"why"` and, where they apply, `"pack"`, `"group"` and
    `"split"`), or `None` when the executor does not say.
    """

    results: list[keras.callbacks.History] | None = None
    error: BaseException | None = None
    path: dict[str, str] | None = None


@dataclass(frozen=True)
class TrialCalls:
    """What an executor training trials in this process gets from the tuner.

    Args:
        objective: the oracle's `keras_tuner.Objective`.
        executions_per_trial: models trained per trial (KerasTuner's `executions_per_trial`).
        fuse: `ModelPack`'s `fuse` argument.
        build_model: `build_model(hp)`: a trial's compiled model, as KerasTuner's
            `Tuner._try_build` builds it, without clearing the Keras session.
        run_alone: `run_alone(trial, *fit_args, **fit_kwargs)`: KerasTuner's `run_trial`
            for one trial (the tuner's own, or its subclass's); returns its results.
        copy_callbacks: `copy_callbacks(callbacks)`: one execution's copies of the search's
            callbacks.
        configure_tensorboard: `configure_tensorboard(callbacks, trial, execution)`: points
            `TensorBoard` callbacks at the execution's log folder.
        checkpoint_file: `checkpoint_file(trial_id)`: the trial's weights file.
        save_build_config: `save_build_config(trial_id, model)`: writes the trial's build
            config (which Hyperband's promoted trials are built from).
        on_epoch_begin: the tuner's `on_epoch_begin(trial, model, epoch, logs=...)`.
        on_epoch_end: the tuner's `on_epoch_end(trial, model, epoch, logs=...)`.
        on_batch_begin: the tuner's `on_batch_begin(trial, model, batch, logs)`.
        on_batch_end: the tuner's `on_batch_end(trial, model, batch, logs)`.
        batch_hooks: whether the tuner's class overrides a batch hook (which then must see
            each batch).
        epoch_end_hook: whether the tuner's class overrides `on_epoch_end` (which may read
            the models' optimizer state).
        build_state: `build_state(model)`: what the build of `model` left of the random
            generators (a `_data_orders.BuildState`), None when not known.
        ledger: where the executor records the programs it compiles and what they compute.
        space: `space()`: a copy of the oracle's search space (`oracle.get_space()`), from
            which the slots executor plans its programs; `None` when not known.
    """

    objective: Any
    executions_per_trial: int
    fuse: str | bool
    build_model: Callable[[Any], keras.Model]
    run_alone: Callable[..., Any]
    copy_callbacks: Callable[[list], list]
    configure_tensorboard: Callable[[list, Any, int], None]
    checkpoint_file: Callable[[str], str]
    save_build_config: Callable[[str, keras.Model], None]
    on_epoch_begin: Callable[..., None]
    on_epoch_end: Callable[..., None]
    on_batch_begin: Callable[..., None]
    on_batch_end: Callable[..., None]
    batch_hooks: bool
    epoch_end_hook: bool
    build_state: Callable[[keras.Model], Any] = lambda model: None
    ledger: SearchLedger = field(default_factory=SearchLedger)
    space: Callable[[], Any] = lambda: None


class NextTrials(Protocol):
    """`next_trials(slots, running=False)`: see `TrialFeed`."""

    def __call__(self, slots: Sequence[int], running: bool = False) -> list: ...


def _not_given(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("This feed was made without it.")


@dataclass(frozen=True)
class TrialFeed:
    """Where an executor's trials come from and where their outcomes go.

    Args:
        slots: how many trials may train at once (the tuner's `parallel_trials`).
        next_trials: `next_trials(slots, running=False)`: asks the oracle for one trial per
            slot number in `slots` and returns those to run, each begun (`on_trial_begin`);
            waits while a remote chief has none yet; an empty list when the search is over
            (asked again then, a remote chief that has told each slot may be gone, and the
            call waits for it), or, with `running=True` (some trial it gave the executor is
            not ended yet: training, or waiting to), when the oracle has none until one of
            them ends.
        end_trials: `end_trials(trials, outcomes)`: reports each trial's `TrialOutcome`
            (`{trial_id: outcome}`) to the oracle and ends it, as KerasTuner would; raises
            a `keras_tuner.errors.FatalError` (or the oracle's error) once all are ended.
        remote: whether the trials come from a chief in another process (the tuner is a
            worker of KerasTuner's distributed tuning). Defaults to `False`.
        one_at_a_time: `one_at_a_time(path, fit_args, fit_kwargs)`: runs the search's
            trials instead with KerasTuner's own loop, one at a time under the tuner's id,
            each with the tuner's `run_trial`, recording `path` (a record of
            `ParallelTuner.trial_paths`) for each. Defaults to raising.
        record_ended: `record_ended(path, reported)`: records the paths workers reported
            (`{trial_id: path}`), then `path` for every other ended trial that has none
            (trials another process ran), and saves the tuner's state. Defaults to raising.
        remaining_trials: `remaining_trials()`: the trials the oracle will still create,
            or `None` when it cannot tell (Hyperband, a remote chief). Defaults to `None`
            always.
    """

    slots: int
    next_trials: NextTrials
    end_trials: Callable[[list, dict], None]
    remote: bool = False
    one_at_a_time: Callable[[dict, tuple, dict], None] = _not_given
    record_ended: Callable[[dict, dict], None] = _not_given
    remaining_trials: Callable[[], int | None] = lambda: None


class Executor(Protocol):
    """Runs trials and reports their outcomes; built once by `ParallelTuner.__init__`.

    A protocol: mypy checks every executor `ParallelTuner._make_executor` returns against
    it, and each class that names it as a base where the class is defined.
    """

    def run(self, feed: TrialFeed, fit_args: tuple, fit_kwargs: dict) -> None:
        """Trains the feed's trials, with the search's `fit` arguments, until none is left.

        Args:
            feed: the `TrialFeed` to take trials from and report outcomes to.
            fit_args: positional arguments of the search's `fit`.
            fit_kwargs: keyword arguments of the search's `fit`.
        """


class AloneFallback(Executor):
    """`executor`, unless the tuner's code must run every trial: then one at a time.

    KerasTuner's own code must run a trial when the tuner overrides `run_trial` (say); such
    trials cannot train together, so they run with KerasTuner's loop (`feed.one_at_a_time`).

    Args:
        executor: the executor that trains trials in this process.
        alone: `alone()`: why the tuner's trials must run one at a time, or `None`; asked
            at each `run` (an instance's `run_trial` may be replaced after it is made).
    """

    def __init__(self, executor: Executor, alone: Callable[[], str | None]) -> None:
        self.executor = executor
        self.alone = alone

    def run(self, feed: TrialFeed, fit_args: tuple, fit_kwargs: dict) -> None:
        reason = self.alone()
        if reason is None:
            self.executor.run(feed, fit_args, fit_kwargs)
            return
        why = f"this tuner runs every trial alone, one at a time, as KerasTuner does: {reason}"
        feed.one_at_a_time({"path": "alone", "why": why}, fit_args, fit_kwargs)
