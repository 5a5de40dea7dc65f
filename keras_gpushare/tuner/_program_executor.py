"""The executor of `ParallelTuner`'s in-process searches: trials trained in programs.

A program (`_program.Program`) is a compiled pack with one slot per trial execution: it
opens (`keras_gpushare.pack.program.open_program`), loads a trial into a free slot, frees a
slot when its trial ends, and fits. Every program's `fit` runs the one epoch callback
(`_program.ProgramEpoch`): each slot's trial sees its own epoch numbers, figures, callbacks,
checkpoint and tuner hooks, and ends when its last epoch does. Two kinds, chosen by
`refills`:

- `"slots"` (`refills=True`): programs hold each slot's settings (learning rate,
  activation, optimizer family) as data and are kept for the rest of the search: when a
  trial ends, its slot frees at once, the next trial is asked for, and a trial whose model
  fits a free slot (`ModelPack.load_member`: the same layers, widths up to the slot's, an
  activation among the slot's) is loaded into it with no new trace. The first program is
  planned from the search space: probe builds of the hypermodel (`_space_plan`) give one
  model per slot. Trials that fit no free slot open a program together.
- `"pack"` (`refills=False`): a round of K trials is asked for; each group of them of one
  batch size, start epoch and length (`_program.round_groups`) opens a program with its
  settings as constants, which trains until its trials have all ended, and goes.

One failure rule for both (`_failed`): the trials of a program that could not be opened
whose models do not fuse train alone, each saying why, and the others open a program
again; a program of several trials that raised otherwise splits into single-trial
programs (rebuilt, each path noting the split); a single-trial program that raises runs its
trial alone with KerasTuner's `run_trial`, as do trials whose model trains itself, while no
program is training (it clears the Keras session).
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from keras_gpushare.pack.program import can_fuse_update, fuse_problem, fuse_update, open_program
from keras_gpushare.tuner._data_orders import DealOrders, OrderCheck, dealt_arguments, trial_order
from keras_gpushare.tuner._executor import Executor, TrialCalls, TrialFeed, TrialOutcome, error_line
from keras_gpushare.tuner._program import (
    Program,
    ProgramEpoch,
    ProgramEpochWithBatches,
    compile_args,
    in_trials,
    not_trained,
    own_training,
    pack_label,
    pack_path,
    prepare_trial,
    round_groups,
    run_alone,
    trial_batch_size,
    trial_start,
    with_split,
)
from keras_gpushare.tuner._search_ledger import EpochCounter
from keras_gpushare.tuner._space_plan import SpacePlan, probe
from keras_gpushare.tuner._trial_callbacks import TrialRun, implements_batch_hooks
from keras_gpushare.tuner._update_payback import expected_steps, fuse_update_pays

logger = logging.getLogger("keras_gpushare.tuner")

# `ProgramExecutor._plan` before the space was probed.
_NOT_PLANNED: Any = object()

# Programs kept with every slot free, for trials to come; the oldest go first beyond this.
MAX_IDLE_PROGRAMS = 2


@dataclass(frozen=True)
class ProgramKind:
    """How one program is compiled (`ProgramExecutor._kind`).

    Args:
        settings_as_data: each slot's settings held as data (a freed slot takes another
            trial's), or constants.
        fuse_update: whether to weigh compiling its optimizer update with XLA against the
            search's remaining steps (`_update_payback`).
    """

    settings_as_data: bool
    fuse_update: bool


class ProgramExecutor(Executor):
    """Trains a search's trials in programs (see the module docstring).

    Args:
        calls: what training a trial needs from the tuner.
        refills: whether freed slots take the next trials (`"slots"`) or programs train a
            round's trials and go (`"pack"`).
    """

    def __init__(self, calls: TrialCalls, refills: bool) -> None:
        self.calls = calls
        self.refills = refills
        self._word = "program" if refills else "pack"
        self._programs: list[Program] = []

    def run(self, feed: TrialFeed, fit_args: tuple, fit_kwargs: dict) -> None:
        self._feed, self._fit_args, self._fit_kwargs = feed, fit_args, fit_kwargs
        self._orders = OrderCheck(fit_args, fit_kwargs)
        self._programs = []
        self._numbers = itertools.count()
        self._slot_of: dict[str, int] = {}
        self._runs_of: dict[str, list[TrialRun]] = {}
        self._trials: dict[str, Any] = {}
        self._paths: dict[str, dict[str, str]] = {}
        self._alone: dict[str, dict[str, str]] = {}
        self._outcomes: dict[str, TrialOutcome] = {}
        self._waiting: list[TrialRun] = []
        # Why no open program took a trial that opens one (for its path).
        self._not_taken_of: dict[str, str] = {}
        self._takes: dict[TrialRun, bool] = {}
        self._free = deque(range(feed.slots))
        self._over = False
        self._stopped_by: Exception | None = None
        self._plan: SpacePlan | None = _NOT_PLANNED
        if self.refills:
            self._stream()
        else:
            self._rounds()

    def _kind(self, runs: list[TrialRun]) -> ProgramKind:
        """The one place each program's kind is chosen, for the trials `runs` it opens
        with: a program that refills holds its settings as data (a trial loaded into a
        freed slot brings its own) and weighs XLA for its update; a round's program
        compiles them as constants."""
        return ProgramKind(settings_as_data=self.refills, fuse_update=self.refills)

    # Rounds ("pack") ----------------------------------------------------------------------

    def _rounds(self) -> None:
        """One round of trials at a time: one per slot, each group of them in a program."""
        while True:
            trials = self._feed.next_trials(range(self._feed.slots))
            if not trials:
                return
            keras.backend.clear_session()
            gc.collect()
            self._outcomes = {}
            runs = [run for trial in trials for run in self._prepare(trial)]
            for group in round_groups(runs, self._fit_kwargs):
                self._open_and_train(group)
            # KerasTuner's run_trial clears the Keras session: only once every program has
            # trained.
            self._run_waiting_alone()
            self._feed.end_trials(trials, self._outcomes)

    def _open_and_train(self, runs: list[TrialRun], split: str | None = None) -> None:
        """A round's program for `runs`, trained at once (where it could be opened)."""
        program = self._open(runs, split=split)
        if program is not None:
            self._train(program)

    # Streaming ("slots") ------------------------------------------------------------------

    def _stream(self) -> None:
        """Trials asked for as slots free, loaded into programs kept for the search."""
        keras.backend.clear_session()
        while True:
            new = self._ask()
            for trial in new:
                for run in self._prepare(trial):
                    if not self._load(run, self._programs):
                        self._waiting.append(run)
            self._open_for_waiting()
            if not self._running():
                # The oracle may have answered IDLE while these trials were pending: ask
                # again once they have ended.
                ran_alone = bool(self._alone)
                self._run_waiting_alone()
                if not new and not ran_alone:
                    if self._stopped_by is not None:
                        raise self._stopped_by
                    return
                continue
            for program in list(self._programs):
                if program.active:
                    self._train(program)

    def _running(self) -> int:
        return sum(len(p.active) for p in self._programs)

    def _ask(self) -> list:
        """A trial for each free slot number the oracle has one for now.

        The oracle is busy while any trial it gave is not ended: training, waiting for a
        program, or waiting to train alone (a trial ends only through `_end`, which lets go
        of its slot number). Once no slot number got a trial with none busy, the search is
        over and no slot asks again: a distributed chief exits as soon as each tuner id it
        has seen was told so, and a later question would wait for a chief that is gone.
        """
        trials: list = []
        while self._free and not self._over:
            number = self._free[0]
            busy = bool(self._slot_of)
            got = self._feed.next_trials([number], running=busy)
            if not got and not busy:
                number, got = self._ask_the_others()
                self._over = not got
            if not got:
                break
            self._free.remove(number)
            self._slot_of[got[0].trial_id] = number
            trials.extend(got)
        return trials

    def _ask_the_others(self) -> tuple[int, list]:
        """With nothing training and no trial for the first free slot number, the other
        free numbers ask too, each under its own tuner id: a distributed chief ends only
        once every tuner id it has seen was told the search is over."""
        for number in list(self._free)[1:]:
            got = self._feed.next_trials([number], running=True)
            if got:
                return number, got
        return self._free[0], []

    def _prepare(self, trial: Any) -> list[TrialRun]:
        """Builds the trial's models (one per execution) and their callbacks; none where
        its build raised (the trial ends) or its model trains itself (it will run alone)."""
        self._trials[trial.trial_id] = trial
        try:
            runs = prepare_trial(self.calls, trial, self._fit_kwargs)
        except Exception as e:
            self._end(trial, TrialOutcome(error=e, path=not_trained(e)))
            return []
        own = own_training(runs[0].model)
        if own:
            self._alone[trial.trial_id] = {"path": "alone", "why": f"its model overrides {own}"}
            return []
        self._runs_of[trial.trial_id] = runs
        for run in runs:
            run.next_epoch = trial_start(run, self._fit_kwargs)
        return runs

    def _open_for_waiting(self) -> None:
        """Loads the waiting trials where a slot fits now; a trial that a busy slot of a
        training program would take waits for it (a program compiled for a few trials costs
        more than the wait); programs are opened for the rest."""
        waiting, self._waiting = self._waiting, []
        by_batch: dict[str, list[TrialRun]] = defaultdict(list)
        training = self._running() > 0
        not_taken: dict[str, str] = {}
        self._not_taken_of = not_taken
        for run in waiting:
            if self._load(run, self._programs):
                continue
            if training and self._a_slot_would_take(run):
                self._waiting.append(run)
            else:
                by_batch[repr(trial_batch_size(run, self._fit_kwargs))].append(run)
                not_taken.setdefault(run.trial.trial_id, self._not_taken(run))
        for runs in by_batch.values():
            runs = self._open_planned(runs, not_taken)
            if runs:
                self._open(runs)

    def _not_taken(self, run: TrialRun) -> str:
        """Why no open program took `run` (for its path: why a program was opened)."""
        batch_size = repr(trial_batch_size(run, self._fit_kwargs))
        reasons = []
        for program in self._programs:
            free = [i for i, occupant in enumerate(program.slots) if occupant is None]
            if program.batch_key != batch_size:
                reasons.append(f"program {program.number} trains another batch size")
            elif not free:
                reasons.append(f"program {program.number} had no free slot")
            else:
                problem = program.pack.load_problem(free[0], run.model)
                reasons.append(f"program {program.number}'s free slots do not take it: {problem}")
        return "; ".join(reasons) or "no program was open"

    def _a_slot_would_take(self, run: TrialRun) -> bool:
        """Whether some slot of a training program of `run`'s batch size, busy or not,
        takes `run`'s model (the answer is kept: programs are only added while it waits)."""
        if run not in self._takes:
            batch_size = repr(trial_batch_size(run, self._fit_kwargs))
            self._takes[run] = any(
                program.pack.load_problem(i, run.model) is None
                for program in self._programs
                if program.batch_key == batch_size and program.active
                for i in range(len(program.slots))
            )
        return self._takes[run]

    def _load(self, run: TrialRun, programs: list[Program], opening: bool = False) -> bool:
        """Loads `run` into a free slot of one of `programs` of its batch size; whether one
        took it. `opening`: the program opens now (planned from the space), no slot freed."""
        batch_size = repr(trial_batch_size(run, self._fit_kwargs))
        for program in programs:
            if program.batch_key != batch_size:
                continue
            index = program.free_slot_for(run.model)
            if index is None:
                continue
            if program.dealt is not None:
                program.orders[index] = trial_order(
                    run, program.dealt, self._fit_kwargs, run.next_epoch
                )
            else:
                self._orders.joins(run, program.runs)
            program.pack.load_member(index, run.model)
            program.slots[index] = run
            if opening:
                why = f"opened program {program.number}, {program.compiled_for}"
            else:
                self.calls.ledger.loaded += 1
                why = (
                    f"loaded into slot {index} of program {program.number} "
                    f"({program.compiled_for}) when a slot freed, with no new trace"
                )
            self._paths[run.trial.trial_id] = _slot_path(program, index, why)
            self._begin(program, index, run)
            return True
        return False

    def _open_planned(self, runs: list[TrialRun], not_taken: dict[str, str]) -> list[TrialRun]:
        """Opens the program planned from the space for `runs`' batch size, unless one is
        open (or there is no plan), and loads into it those of `runs` that fit; returns the
        others, with why it did not take them in `not_taken`."""
        batch_key = repr(trial_batch_size(runs[0], self._fit_kwargs))
        if any(p.planned and p.batch_key == batch_key for p in self._programs):
            return runs
        plan = self._space_plan()
        if plan is None:
            return runs
        try:
            program = self._new_program(plan.models, runs, plan=plan)
        except Exception as e:
            logger.warning("The program planned from the space could not be built: %s", e)
            self._plan = None
            return runs
        for index in range(len(program.slots)):
            program.pack.stop_member(index)
        rest = [run for run in runs if not self._load(run, [program], opening=True)]
        for run in rest:
            not_taken[run.trial.trial_id] = self._not_taken(run)
        return rest

    def _space_plan(self) -> SpacePlan | None:
        """The probe models of the program planned from the space (`_space_plan`), made at
        the first call; `None` where there is no plan (no space, or nothing fuses)."""
        if self._plan is _NOT_PLANNED:
            self._plan = None
            space = self.calls.space()
            if space is not None and self.calls.fuse is not False and self._feed.slots > 1:
                self._plan = probe(space, self.calls.build_model, self._feed.slots)
                if self._plan is not None:
                    self.calls.ledger.probed(self._plan.builds, self._plan.seconds)
        return self._plan

    # Programs -----------------------------------------------------------------------------

    def _open(self, runs: list[TrialRun], split: str | None = None) -> Program | None:
        """A new program for `runs`, each trial's path said (where it refills, with why no
        open program took the trial, `_not_taken_of`); `None` where it could not be opened
        (`_failed` took its trials). `split`: the failed program whose split opens it."""
        try:
            program = self._new_program([run.model for run in runs], runs)
        except Exception as e:
            self._failed(runs, e, split, opening=True)
            return None
        label = pack_label(runs, self._fit_kwargs)
        for index, run in enumerate(runs):
            trial_id = run.trial.trial_id
            if self.refills:
                why = (
                    f"opened program {program.number} with trials {program.opened_for} "
                    f"({self._not_taken_of.get(trial_id, 'no program was open')})"
                )
                path = _slot_path(program, index, why)
            else:
                path = pack_path(program.pack, runs, trial_id, label)
            self._paths[trial_id] = with_split(path, split)
        if self.refills:
            for index, run in enumerate(runs):
                self._begin(program, index, run)
        return program

    def _new_program(
        self, models: list[keras.Model], runs: list[TrialRun], plan: SpacePlan | None = None
    ) -> Program:
        """Opens and compiles a program whose slots hold `models` (`runs`' models, or the
        probe models of `plan`), for `runs` and, where it refills, the trials to come."""
        kind = self._kind(runs)
        callbacks = [cb for run in runs for cb in run.callbacks]
        batch_hooks = self.calls.batch_hooks or implements_batch_hooks(callbacks)
        dealt = None
        if self._orders.deals(runs, program=self.refills):
            batch_size = trial_batch_size(runs[0], self._fit_kwargs)
            dealt = dealt_arguments(self._fit_args, self._fit_kwargs, batch_size, len(models))
        pack = open_program(models, self.calls.fuse, kind.settings_as_data, dealt is not None)
        pack.compile(**compile_args(models, batch_hooks))
        self.calls.ledger.compiled(pack, models)
        fused = kind.fuse_update and self._fuse_update(pack, runs)
        batch_key = repr(trial_batch_size(runs[0], self._fit_kwargs))
        slots: list[TrialRun | None] = [None] * len(models) if plan else list(runs)
        planned = None if plan is None else plan.why(len(pack.engine_plan.groups))
        number = next(self._numbers)
        program = Program(number, pack, slots, batch_key, batch_hooks, self.refills, dealt, planned)
        if dealt is not None and plan is None:
            program.orders = [
                trial_order(run, dealt, self._fit_kwargs, run.next_epoch) for run in runs
            ]
        if self.refills:
            idle = [p for p in self._programs if not p.active]
            for old in idle[: max(0, len(idle) + 1 - MAX_IDLE_PROGRAMS)]:
                self._programs.remove(old)
            self._programs.append(program)
            logger.info(
                "Program %d: %s, in %d slots (%s engine)%s%s.",
                program.number,
                planned or f"trials {program.opened_for}",
                len(models),
                pack.engine,
                "; its optimizer update compiled with XLA" if fused else "",
                "; each slot on its own trial's data order" if dealt else "",
            )
        return program

    def _fuse_update(self, pack: Any, runs: list[TrialRun]) -> bool:
        """Sets the program's optimizer to compile its update with XLA where the search's
        remaining steps repay it (`_update_payback`); whether it did."""
        if not can_fuse_update(pack):
            return False
        remaining = self._feed.remaining_trials()
        trial_epochs = None
        if remaining is not None:
            kwargs = self._fit_kwargs
            per_trial = kwargs.get("epochs", 1) - kwargs.get("initial_epoch", 0)
            executions = len(runs) / len({run.trial.trial_id for run in runs})
            trial_epochs = sum(run.last_epoch - run.next_epoch for run in runs)
            trial_epochs += remaining * executions * per_trial
        steps = expected_steps(
            trial_epochs,
            len(runs),
            trial_batch_size(runs[0], self._fit_kwargs),
            self._fit_args,
            self._fit_kwargs,
        )
        parameters = sum(int(np.prod(w.shape)) for w in pack.trainable_weights)
        fused = fuse_update_pays(steps, parameters)
        fuse_update(pack, fused)
        return fused

    def _begin(
        self, program: Program, index: int, run: TrialRun, params: dict | None = None
    ) -> None:
        """The trial execution starts in slot `index`: its callbacks see `on_train_begin`
        (with the program's `fit` `params`, where it begins with the fit)."""
        # The slot's occupant, not `pack.members` (which copies every slot's weights out).
        run.model = program.pack.member_model(index)
        run.model.stop_training = False
        run.index = index
        if params is None:
            params = {"epochs": run.last_epoch, "verbose": 0, "steps": None}
        for callback in run.callbacks:
            callback.set_model(run.model)
            callback.set_params(params)
            callback.on_train_begin({})
        if run.next_epoch >= run.last_epoch:
            self._slot_ended(program, index, run)

    # Training -----------------------------------------------------------------------------

    def _train(self, program: Program) -> None:
        """One `fit` of `program`, for as many epochs as its trials still need; at each
        epoch's end, ended trials free their slots (and, in a program that refills, new ones
        are loaded into them). The fit ends early when its slots are all free or trials wait
        for another program."""
        feed, kwargs = self._fit_args, dict(self._fit_kwargs)
        own_orders: list[keras.callbacks.Callback] = []
        if program.dealt is not None:
            dataset, kwargs = program.dealt
            feed, kwargs = (dataset,), dict(kwargs)
            own_orders = [DealOrders(dataset, lambda: list(program.orders))]
        kwargs.pop("callbacks", None)
        runs = program.runs
        start = 0 if self.refills else runs[0].next_epoch
        epochs = max(run.last_epoch - run.next_epoch for run in runs)
        kwargs.update(epochs=start + epochs, initial_epoch=start)
        batch_size = trial_batch_size(runs[0], self._fit_kwargs)
        if batch_size is not None and program.dealt is None:
            kwargs["batch_size"] = batch_size
        raised: list[BaseException] = []
        callbacks = [*own_orders, self._epoch_callback(program, raised)]
        callbacks.append(
            EpochCounter(
                self.calls.ledger, program.pack, lambda: [r.trial.trial_id for r in program.runs]
            )
        )
        if not self.refills:
            logger.info(
                "Training trials %s as one pack of %d models (%s engine)%s.",
                program.opened_for,
                len(runs),
                program.pack.engine,
                ", each on its own trial's data order" if program.dealt else "",
            )
        try:
            program.pack.fit(*feed, callbacks=callbacks, **kwargs)
        except Exception as e:
            if program in self._programs:
                self._programs.remove(program)
            self._fit_failed(program, e)
            return
        if raised:
            raise raised[0]

    def _epoch_callback(self, program: Program, raised: list[BaseException]) -> ProgramEpoch:
        """The program's `ProgramEpoch`; the tuner's errors in ending or asking for trials
        go to `raised` (see `_ended`)."""

        def ended(runs: list[TrialRun]) -> bool:
            # The tuner's errors (a FatalError once too many trials failed) end the search,
            # not the program: they are raised again once the fit has returned.
            try:
                return self._ended(program, runs)
            except BaseException as e:
                raised.append(e)
                return True

        def begin(params: dict) -> None:
            for index, run in enumerate(list(program.slots)):
                if run is not None:
                    self._begin(program, index, run, params)

        hooks = ProgramEpochWithBatches if program.batch_hooks else ProgramEpoch
        optimizer_state = bool(self.calls.epoch_end_hook)
        return hooks(program, optimizer_state, ended, None if program.refills else begin)

    def _ended(self, program: Program, runs: list[TrialRun]) -> bool:
        """`runs` ended their last epoch: their slots free (and are refilled, where the
        program refills); whether the program's fit should stop."""
        for run in runs:
            self._slot_ended(program, run.index, run)
        if not program.refills:
            return not program.active
        self._waiting = [r for r in self._waiting if not self._load(r, [program])]
        if any(slot is None for slot in program.slots):
            for trial in self._ask():
                for run in self._prepare(trial):
                    if not self._load(run, [program]):
                        self._waiting.append(run)
        return (
            not program.active
            or bool(self._alone)
            or not all(self._a_slot_would_take(run) for run in self._waiting)
        )

    def _slot_ended(self, program: Program, index: int, run: TrialRun) -> None:
        """Frees slot `index`; ends the trial once all its executions have ended."""
        program.slots[index] = None
        program.orders[index] = None
        if program.refills or any(r.last_epoch > run.next_epoch for r in program.runs):
            # A round's program stops no member at its last epoch (nothing trains after).
            program.pack.stop_member(index)
        run.active = False
        trial_id = run.trial.trial_id
        runs = self._runs_of.get(trial_id, [])
        if any(r.active for r in runs):
            return
        self._runs_of.pop(trial_id, None)
        runs[0].checkpoint.write()
        for r in runs:
            r.end()
        self.calls.save_build_config(trial_id, runs[0].model)
        outcome = TrialOutcome(results=[r.results() for r in runs], path=self._paths[trial_id])
        self._end(self._trials[trial_id], outcome)

    # The failure rule ---------------------------------------------------------------------

    def _fit_failed(self, program: Program, error: Exception) -> None:
        """`program`'s fit raised `error`: its trials not ended yet go by `_failed`; a
        program planned from the space is not planned again (a probe may be to blame)."""
        if program.planned:
            self._plan = None
        runs = [
            run
            for trial_id in dict.fromkeys(run.trial.trial_id for run in program.runs)
            for run in self._runs_of.get(trial_id, [])
        ]
        split = self._paths.get(runs[0].trial.trial_id, {}).get("split") if runs else None
        if runs:
            self._failed(runs, error, split, number=program.number, members=program.slots)

    def _failed(
        self,
        runs: list[TrialRun],
        error: Exception,
        split: str | None,
        opening: bool = False,
        number: int | None = None,
        members: Sequence[TrialRun | None] | None = None,
    ) -> None:
        """The one rule for a program of `runs` that could not be opened (`opening`) or
        whose fit raised `error` (program `number`): where it could not be opened, the
        trials whose models do not fuse train alone and the others open a program again;
        else one of several trials splits into single-trial programs, each trial rebuilt
        (its path notes the split), and a single trial trains alone with KerasTuner's code.
        `split`: the failed program whose split opened this one; `members`: its slots'
        occupants, where they are not `runs` (to name the trials in its error)."""
        trials = list(dict.fromkeys(run.trial for run in runs))
        if opening and self._blame(runs):
            rest = [run for run in runs if run.trial.trial_id in self._runs_of]
            if rest:
                self._reopen(rest, split)
            return
        for run in runs:
            run.abandon()
        raised = in_trials(error_line(error), runs if members is None else members)
        if len(trials) == 1:
            self._runs_of.pop(trials[0].trial_id, None)
            if not self.refills:
                why = f"its pack raised {raised}"
            elif opening:
                why = (
                    "it trains alone, with KerasTuner's code, as a program for it could not "
                    f"be built: {raised.rstrip('.')}"
                )
            else:
                why = f"its program {number} raised {raised}"
            self._alone[trials[0].trial_id] = with_split({"path": "alone", "why": why}, split)
            return
        logger.warning(
            "A %s of %d trials raised %s: %s; training each trial alone to find which.",
            self._word,
            len(trials),
            type(error).__name__,
            error,
        )
        split = (
            f"the {self._word} of {pack_label(runs, self._fit_kwargs)} raised {raised}; each "
            f"of its trials was then {'packed' if not self.refills else 'given a program'} "
            "alone to find which"
        )
        for trial in trials:
            self._runs_of.pop(trial.trial_id, None)
            try:
                again = prepare_trial(self.calls, trial, self._fit_kwargs)
            except Exception as e:
                outcome = TrialOutcome(error=e, path=with_split(not_trained(e), split))
                self._end(trial, outcome)
                continue
            self._runs_of[trial.trial_id] = again
            for run in again:
                run.next_epoch = trial_start(run, self._fit_kwargs)
            self._reopen(again, split)

    def _blame(self, runs: list[TrialRun]) -> bool:
        """Sends alone the trials of `runs` whose models do not fuse, each naming its own
        layer; whether there were any."""
        alone: dict[str, str] = {}
        for run in runs:
            problem = fuse_problem(run.model)
            if problem is not None:
                trial_id = run.trial.trial_id
                alone.setdefault(trial_id, f"trial {trial_id} cannot fuse: {problem}")
        for trial_id, problem in alone.items():
            self._runs_of.pop(trial_id, None)
            why = (
                f"it trains alone, with KerasTuner's code, as a {self._word} for it could "
                f"not be built: {problem}"
            )
            self._alone[trial_id] = {"path": "alone", "why": why}
        return bool(alone)

    def _reopen(self, runs: list[TrialRun], split: str | None) -> None:
        """A program for `runs` after a failure: trained at once in a round, or by the
        stream's loop."""
        if self.refills:
            self._open(runs, split=split)
        else:
            self._open_and_train(runs, split)

    # Ending trials ------------------------------------------------------------------------

    def _run_waiting_alone(self) -> None:
        """Trials that must train alone, with KerasTuner's `run_trial`, while no program is.

        It clears the Keras session, so the idle programs are let go first."""
        if self._alone:
            self._programs = []
        for trial_id, path in list(self._alone.items()):
            del self._alone[trial_id]
            trial = self._trials[trial_id]
            self._end(trial, run_alone(self.calls, trial, path, self._fit_args, self._fit_kwargs))

    def _end(self, trial: Any, outcome: TrialOutcome) -> None:
        """Reports the trial's outcome to the oracle and frees its slot number (in a
        round, at the round's end).

        An error the tuner raises in ending it (a `FatalError`, too many consecutive
        failures) stops the search as a round's does: no trial is asked for after it,
        the trials already begun go on to their end, and `run` raises it then."""
        if not self.refills:
            self._outcomes[trial.trial_id] = outcome
            return
        try:
            self._feed.end_trials([trial], {trial.trial_id: outcome})
        except Exception as e:
            self._stopped_by = self._stopped_by or e
            self._over = True
        finally:
            self._free.append(self._slot_of.pop(trial.trial_id))


def _slot_path(program: Program, index: int, why: str) -> dict[str, str]:
    return {"path": "slot", "program": str(program.number), "slot": str(index), "why": why}
