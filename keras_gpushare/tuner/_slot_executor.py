"""The "slots" executor: trials streamed through the slots of compiled packs, refilled in place.

The pack executor trains a round of K trials as new packs and waits for the round's slowest
trial; every round builds, fuses, traces and compiles again. This executor keeps each pack it
builds (a "program") for the rest of the search: when a trial ends (its epochs done, stopped
early), its slot frees at once, the next trial is asked for, and a trial whose model fits a
free slot (`ModelPack.load_member`: the same layers, widths up to the slot's, an activation
among the slot's, any dropout rate and learning rate) is loaded into it and starts at the
next epoch, with no new trace. The first program is planned from the search space: probe
builds of the hypermodel at the extremes and choices of its hyperparameters (`_space_plan`)
give one model per slot, and the trials are loaded into its slots. Trials that fit no free
slot open a new program together; in a program that cannot be built, those that do not
fuse train alone, each saying why, and the others keep a program.
Each slot counts its own trial's epochs; the trial's callbacks, checkpoint, tuner hooks and
outcome are the pack executor's. Trials whose model trains itself run alone with KerasTuner's
`run_trial` while no program is training (it clears the Keras session).
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict, deque
from typing import Any

import keras
import numpy as np

from keras_gpushare.pack import ModelPack
from keras_gpushare.pack.program import can_fuse_update, fuse_problem, fuse_update, open_program
from keras_gpushare.tuner._data_orders import (
    DealOrders,
    DealtBatches,
    OrderCheck,
    TrialOrder,
    dealt_arguments,
    trial_order,
)
from keras_gpushare.tuner._executor import TrialCalls, TrialFeed, TrialOutcome, error_line
from keras_gpushare.tuner._pack_executor import (
    PackExecutor,
    _batch_size,
    _compile_args,
    _in_trials,
    _not_trained,
    _own_training,
    _prepare,
    _run_alone,
    _start_epoch,
)
from keras_gpushare.tuner._search_ledger import EpochCounter
from keras_gpushare.tuner._space_plan import SpacePlan, probe
from keras_gpushare.tuner._trial_callbacks import TrialRun, implements_batch_hooks
from keras_gpushare.tuner._update_payback import expected_steps, fuse_update_pays

logger = logging.getLogger("keras_gpushare.tuner")

# `SlotExecutor._plan` before the space was probed.
_NOT_PLANNED: Any = object()

# Programs kept with every slot free, for trials to come; the oldest go first beyond this.
MAX_IDLE_PROGRAMS = 2


class _Program:
    """One compiled pack, the trial execution in each of its slots (`None`: free), and the
    trials it was opened for."""

    def __init__(
        self,
        number: int,
        pack: ModelPack,
        runs: list[TrialRun | None],
        batch_key: str,
        batch_hooks: bool,
        dealt: tuple[DealtBatches, dict] | None = None,
        planned: str | None = None,
    ) -> None:
        self.number = number
        self.pack = pack
        self.batch_key = batch_key
        self.slots: list[TrialRun | None] = list(runs)
        self.batch_hooks = batch_hooks
        # Why it was opened: for trials `opened_for`, or `planned` from the search space.
        self.opened_for = ", ".join(dict.fromkeys(run.trial.trial_id for run in runs if run))
        self.planned = planned
        # Where each slot trains on its own trial's data order: the program's batches, its
        # `fit` arguments, and each slot's `TrialOrder`.
        self.dealt = dealt
        self.orders: list[TrialOrder | None] = [None] * len(runs)

    @property
    def compiled_for(self) -> str:
        """What the program was compiled for, for the trials' paths."""
        return self.planned or f"compiled for trials {self.opened_for}"

    @property
    def active(self) -> list[int]:
        return [i for i, run in enumerate(self.slots) if run is not None]

    @property
    def runs(self) -> list[TrialRun]:
        """The trial executions in the slots, in slot order (each `run.index` its slot)."""
        return [run for run in self.slots if run is not None]

    def free_slot_for(self, model: keras.Model) -> int | None:
        """A free slot `model` loads into, or `None`."""
        for i, occupant in enumerate(self.slots):
            if occupant is None and self.pack.load_problem(i, model) is None:
                return i
        return None


class _SlotEpoch(keras.callbacks.Callback):
    """A program's epochs: each slot's trial sees its own epoch number and figures; at each
    epoch's end, `refill(ended)` ends the trials whose last epoch it was and refills their
    slots, and says whether the fit should stop (no trial left, or trials wait for another
    program)."""

    def __init__(self, program: _Program, optimizer_state: bool, refill: Any) -> None:
        super().__init__()
        self.program = program
        self.optimizer_state = optimizer_state
        self.refill = refill

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        for run in self.program.runs:
            run.begin_epoch(run.next_epoch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        runs = self.program.runs
        optimizer_state = self.optimizer_state or any(run.callbacks for run in runs)
        members = self.program.pack.refresh_members(optimizer_state=optimizer_state)
        ended = []
        for run in runs:
            run.end_epoch(run.next_epoch, logs, members[run.index])
            run.next_epoch += 1
            if run.model.stop_training or run.next_epoch >= run.last_epoch:
                ended.append(run)
        if self.refill(ended):
            self.model.stop_training = True


class _SlotEpochWithBatches(_SlotEpoch):
    """`_SlotEpoch` that also forwards train-batch events to each slot's trial."""

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        for run in self.program.runs:
            run.begin_batch(batch, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        for run in self.program.runs:
            run.end_batch(batch, logs)


class SlotExecutor(PackExecutor):
    """The "slots" executor (see the module docstring).

    Args:
        calls: what training a trial needs from the tuner.
    """

    def __init__(self, calls: TrialCalls) -> None:
        super().__init__(calls)
        self._programs: list[_Program] = []

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
        self._waiting: list[TrialRun] = []
        self._takes: dict[TrialRun, bool] = {}
        self._free = deque(range(feed.slots))
        self._over = False
        self._stopped_by: Exception | None = None
        self._plan: SpacePlan | None = _NOT_PLANNED
        keras.backend.clear_session()
        while True:
            new = self._ask()
            self._place(new)
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

    # Trials in ----------------------------------------------------------------------------

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

    def _place(self, trials: list, program: _Program | None = None) -> None:
        """Loads each trial's models into free slots that fit (of `program` only, if given);
        the others wait for `_open_for_waiting`."""
        for trial in trials:
            self._trials[trial.trial_id] = trial
            try:
                runs = _prepare(self.calls, trial, self._fit_kwargs)
            except Exception as e:
                self._end(trial, TrialOutcome(error=e, path=_not_trained(e)))
                continue
            own = _own_training(runs[0].model)
            if own:
                self._alone[trial.trial_id] = {"path": "alone", "why": f"its model overrides {own}"}
                continue
            self._runs_of[trial.trial_id] = runs
            for run in runs:
                run.next_epoch = _start_epoch(run, self._fit_kwargs)
                if not self._load(run, [program] if program else self._programs):
                    self._waiting.append(run)

    def _open_for_waiting(self) -> None:
        """Loads the waiting trials where a slot fits now; a trial that a busy slot of a
        training program would take waits for it (a program compiled for a few trials costs
        more than the wait); programs are opened for the rest."""
        waiting, self._waiting = self._waiting, []
        by_batch: dict[str, list[TrialRun]] = defaultdict(list)
        training = self._running() > 0
        not_taken: dict[str, str] = {}
        for run in waiting:
            if self._load(run, self._programs):
                continue
            if training and self._a_slot_would_take(run):
                self._waiting.append(run)
            else:
                by_batch[repr(_batch_size(run, self._fit_kwargs))].append(run)
                not_taken.setdefault(run.trial.trial_id, self._not_taken(run))
        for runs in by_batch.values():
            self._open(runs, not_taken)

    def _not_taken(self, run: TrialRun) -> str:
        """Why no open program took `run` (for its path: why a program was opened)."""
        batch_size = repr(_batch_size(run, self._fit_kwargs))
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
            batch_size = repr(_batch_size(run, self._fit_kwargs))
            self._takes[run] = any(
                program.pack.load_problem(i, run.model) is None
                for program in self._programs
                if program.batch_key == batch_size and program.active
                for i in range(len(program.slots))
            )
        return self._takes[run]

    def _load(self, run: TrialRun, programs: list[_Program], opening: bool = False) -> bool:
        """Loads `run` into a free slot of one of `programs` of its batch size; whether one
        took it. `opening`: the program opens now (planned from the space), no slot freed."""
        batch_size = repr(_batch_size(run, self._fit_kwargs))
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
            self._begin(program, index, run)
            if opening:
                why = f"opened program {program.number}, {program.compiled_for}"
            else:
                self.calls.ledger.loaded += 1
                why = (
                    f"loaded into slot {index} of program {program.number} "
                    f"({program.compiled_for}) when a slot freed, with no new trace"
                )
            self._paths[run.trial.trial_id] = _path(program, index, why)
            return True
        return False

    def _open(self, runs: list[TrialRun], not_taken: dict[str, str]) -> None:
        """A new program for `runs` (first the program planned from the space, where none of
        their batch size is open and it takes some of them); runs alone (KerasTuner's code)
        the trials no program can take. `not_taken`: why the open programs took none of
        them, by trial id."""
        runs = self._open_planned(runs, not_taken)
        while runs:
            try:
                program = self._new_program([run.model for run in runs], runs)
            except Exception as e:
                runs = self._split(runs, e)
                continue
            for index, run in enumerate(runs):
                self._begin(program, index, run)
                why = (
                    f"opened program {program.number} with trials {program.opened_for} "
                    f"({not_taken.get(run.trial.trial_id, 'no program was open')})"
                )
                self._paths[run.trial.trial_id] = _path(program, index, why)
            return

    def _split(self, runs: list[TrialRun], error: Exception) -> list[TrialRun]:
        """After a program for `runs` could not be built (`error`): the trials whose models
        do not fuse train alone, each saying why, and the others are returned to share a
        program; when none of them is to blame, all train alone, saying what raised."""
        alone: dict[str, str] = {}
        for run in runs:
            problem = fuse_problem(run.model)
            if problem is not None:
                alone.setdefault(
                    run.trial.trial_id, f"trial {run.trial.trial_id} cannot fuse: {problem}"
                )
        rest = [run for run in runs if run.trial.trial_id not in alone]
        if not alone:
            alone = {
                run.trial.trial_id: _in_trials(error_line(error), runs).rstrip(".") for run in runs
            }
            rest = []
        for trial_id, problem in alone.items():
            self._runs_of.pop(trial_id, None)
            why = (
                "it trains alone, with KerasTuner's code, as a program for it could not "
                f"be built: {problem}"
            )
            self._alone[trial_id] = {"path": "alone", "why": why}
        return rest

    def _open_planned(self, runs: list[TrialRun], not_taken: dict[str, str]) -> list[TrialRun]:
        """Opens the program planned from the space for `runs`' batch size, unless one is
        open (or there is no plan), and loads into it those of `runs` that fit; returns the
        others, with why it did not take them in `not_taken`."""
        batch_key = repr(_batch_size(runs[0], self._fit_kwargs))
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

    def _new_program(
        self, models: list[keras.Model], runs: list[TrialRun], plan: SpacePlan | None = None
    ) -> _Program:
        """Builds and compiles a program whose slots hold `models` (`runs`' models, or the
        probe models of `plan`), for `runs` and the trials to come."""
        callbacks = [cb for run in runs for cb in run.callbacks]
        batch_hooks = self.calls.batch_hooks or implements_batch_hooks(callbacks)
        dealt = None
        if self._orders.deals(runs, program=True):
            batch_size = _batch_size(runs[0], self._fit_kwargs)
            dealt = dealt_arguments(self._fit_args, self._fit_kwargs, batch_size, len(models))
        pack = open_program(models, self.calls.fuse, settings_as_data=True, dealt=bool(dealt))
        pack.compile(**_compile_args(models, batch_hooks))
        self.calls.ledger.compiled(pack, models, slot_values=True)
        fused = self._fuse_update(pack, runs)
        batch_key = repr(_batch_size(runs[0], self._fit_kwargs))
        slots: list[TrialRun | None] = [None] * len(models) if plan else list(runs)
        planned = None
        if plan is not None:
            planned = plan.why(len(pack.engine_plan.groups))
        program = _Program(next(self._numbers), pack, slots, batch_key, batch_hooks, dealt, planned)
        if dealt is not None and plan is None:
            program.orders = [
                trial_order(run, dealt, self._fit_kwargs, run.next_epoch) for run in runs
            ]
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

    def _fuse_update(self, pack: ModelPack, runs: list[TrialRun]) -> bool:
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
            _batch_size(runs[0], self._fit_kwargs),
            self._fit_args,
            self._fit_kwargs,
        )
        parameters = sum(int(np.prod(w.shape)) for w in pack.trainable_weights)
        fused = fuse_update_pays(steps, parameters)
        fuse_update(pack, fused)
        return fused

    def _begin(self, program: _Program, index: int, run: TrialRun) -> None:
        """The trial execution starts in slot `index`: its callbacks see `on_train_begin`."""
        # The slot's occupant, not `pack.members` (which copies every slot's weights out).
        run.model = program.pack.member_model(index)
        run.index = index
        params = {"epochs": run.last_epoch, "verbose": 0, "steps": None}
        for callback in run.callbacks:
            callback.set_model(run.model)
            callback.set_params(params)
            callback.on_train_begin({})
        if run.next_epoch >= run.last_epoch:
            self._slot_ended(program, index, run)

    # Training -----------------------------------------------------------------------------

    def _train(self, program: _Program) -> None:
        """One `fit` of `program`, for as many epochs as its trials still need; at each
        epoch's end, ended trials free their slots and new ones are loaded into them. The fit
        ends early when its slots are all free or trials wait for another program."""
        feed, kwargs = self._fit_args, dict(self._fit_kwargs)
        own_orders: list[keras.callbacks.Callback] = []
        if program.dealt is not None:
            dataset, kwargs = program.dealt
            feed, kwargs = (dataset,), dict(kwargs)
            own_orders = [DealOrders(dataset, lambda: list(program.orders))]
        kwargs.pop("callbacks", None)
        runs = program.runs
        epochs = max(run.last_epoch - run.next_epoch for run in runs)
        kwargs.update(epochs=epochs, initial_epoch=0)
        batch_size = _batch_size(runs[0], self._fit_kwargs)
        if batch_size is not None and program.dealt is None:
            kwargs["batch_size"] = batch_size

        raised: list[BaseException] = []

        def refill(ended: list[TrialRun]) -> bool:
            # The tuner's errors (a FatalError once too many trials failed) end the search,
            # not the program: they are raised again once the fit has returned.
            try:
                for run in ended:
                    self._slot_ended(program, run.index, run)
                self._waiting = [r for r in self._waiting if not self._load(r, [program])]
                if any(slot is None for slot in program.slots):
                    self._place(self._ask(), program)
            except BaseException as e:
                raised.append(e)
                return True
            return (
                not program.active
                or bool(self._alone)
                or not all(self._a_slot_would_take(run) for run in self._waiting)
            )

        hooks = _SlotEpochWithBatches if program.batch_hooks else _SlotEpoch
        epoch = hooks(program, bool(self.calls.epoch_end_hook), refill)
        counter = EpochCounter(
            self.calls.ledger, program.pack, lambda: [r.trial.trial_id for r in program.runs]
        )
        try:
            program.pack.fit(*feed, callbacks=[*own_orders, epoch, counter], **kwargs)
        except Exception as e:
            self._programs.remove(program)
            logger.warning(
                "Program %d raised %s: %s; its trials run alone.",
                program.number,
                type(e).__name__,
                e,
            )
            for occupant in program.runs:
                trial_id = occupant.trial.trial_id
                if trial_id in self._runs_of:
                    for run in self._runs_of.pop(trial_id):
                        run.abandon()
                    why = f"its program {program.number} raised {error_line(e)}"
                    self._alone[trial_id] = {"path": "alone", "why": why}
            return
        if raised:
            raise raised[0]

    def _slot_ended(self, program: _Program, index: int, run: TrialRun) -> None:
        """Frees slot `index`; ends the trial once all its executions have ended."""
        program.slots[index] = None
        program.orders[index] = None
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

    def _run_waiting_alone(self) -> None:
        """Trials that must train alone, with KerasTuner's `run_trial`, while no program is.

        It clears the Keras session, so the idle programs are let go first."""
        if self._alone:
            self._programs = []
        for trial_id, path in list(self._alone.items()):
            del self._alone[trial_id]
            trial = self._trials[trial_id]
            self._end(trial, _run_alone(self.calls, trial, path, self._fit_args, self._fit_kwargs))

    def _end(self, trial: Any, outcome: TrialOutcome) -> None:
        """Reports the trial's outcome to the oracle and frees its slot number.

        An error the tuner raises in ending it (a `FatalError`, too many consecutive
        failures) stops the search as a pack round's does: no trial is asked for after it,
        the trials already begun go on to their end, and `run` raises it then."""
        try:
            self._feed.end_trials([trial], {trial.trial_id: outcome})
        except Exception as e:
            self._stopped_by = self._stopped_by or e
            self._over = True
        finally:
            self._free.append(self._slot_of.pop(trial.trial_id))


def _path(program: _Program, index: int, why: str) -> dict[str, str]:
    return {"path": "slot", "program": str(program.number), "slot": str(index), "why": why}
