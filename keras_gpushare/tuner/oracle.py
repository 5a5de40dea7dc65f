"""`ParallelOracle`: any KerasTuner oracle, handing out several trials at once, safely."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import keras_tuner

from keras_gpushare import _upstream
from keras_gpushare.tuner import _state

logger = logging.getLogger("keras_gpushare.tuner")

if TYPE_CHECKING:
    from keras_tuner.engine.trial import Trial

trial_module = _upstream.kt_trial_module()
TrialStatus = trial_module.TrialStatus
_ENDED = (TrialStatus.COMPLETED, TrialStatus.FAILED)
# Proposals asked of the wrapped oracle before a trial that would repeat a running one is
# drawn at random instead (`ParallelOracle._distinct_from_running`).
PROPOSALS = 3

# Attributes that live on the wrapper; every other attribute is the wrapped oracle's.
_OWN_ATTRIBUTES = frozenset(
    {"oracle", "parallel_trials", "fatal_error", "_lock", "_trial_ended", "_started", "_restarts"}
)


class ParallelOracle(keras_tuner.Oracle):
    """Wraps a KerasTuner oracle so that several trials run at once, under one lock.

    The wrapped oracle (`RandomSearch`, `BayesianOptimization`, `Hyperband`, `GridSearch` or
    your own) keeps deciding which trials to run; `ParallelOracle` serializes every call to
    it with its own lock, which is released even when the oracle raises (KerasTuner's
    `@synchronized` lock is not, and a later call from another thread then hangs). It hands
    out at most `parallel_trials` trials at a time, one per tuner id; `wait_for_trial`
    blocks (without polling) while the oracle answers "IDLE", until a running trial ends.

    Its state files are written atomically, each finished trial is logged on the
    `keras_gpushare.tuner` logger (id, status, score, elapsed time, hyperparameters), and a
    project reloaded after a crash resumes exactly: trials that had finished are not run
    again, and trials that were running (or only half recorded) are queued to run again.

    Every attribute and method not listed here is the wrapped oracle's (`objective`,
    `max_trials`, `trials`, `ongoing_trials`, `get_best_trials`, ...), and the wrapper is
    an instance of the wrapped oracle's class: `ParallelOracle(BayesianOptimizationOracle(
    ...))` is a `ParallelBayesianOptimizationOracle`, a subclass of both, made once per
    wrapped class, so `isinstance` checks written for KerasTuner's oracle hold.

    Args:
        oracle: the `keras_tuner.Oracle` instance to wrap.
        parallel_trials: the most trials running at once, or `None` for no limit (the
            number of workers asking is then the limit). Defaults to `None`.

    Example:

    ```python
    import keras_tuner
    import keras_gpushare as kg

    oracle = kg.tuner.ParallelOracle(
        keras_tuner.oracles.RandomSearchOracle(objective="val_loss", max_trials=8, seed=1),
        parallel_trials=4,
    )
    oracle.oracle.max_trials   # 8: the wrapped oracle, reachable as `oracle.oracle`
    isinstance(oracle, keras_tuner.oracles.RandomSearchOracle)   # True
    ```
    """

    def __new__(cls, oracle: keras_tuner.Oracle, parallel_trials: int | None = None) -> Any:
        if cls is ParallelOracle and _wrappable(oracle):
            cls = _wrapper_class(type(oracle))
        return super().__new__(cls)

    def __init__(self, oracle: keras_tuner.Oracle, parallel_trials: int | None = None) -> None:
        if isinstance(oracle, ParallelOracle):
            raise ValueError(
                "Invalid value for argument `oracle`: it is already a ParallelOracle. Pass "
                "the KerasTuner oracle it wraps (`oracle.oracle`) instead."
            )
        if not isinstance(oracle, keras_tuner.Oracle):
            raise TypeError(
                "Invalid value for argument `oracle`: expected a `keras_tuner.Oracle` "
                f"instance, got {type(oracle).__name__}. Pass e.g. "
                "`keras_tuner.oracles.RandomSearchOracle(objective='val_loss', max_trials=20)`."
            )
        if parallel_trials is not None and (
            not isinstance(parallel_trials, int)
            or isinstance(parallel_trials, bool)
            or parallel_trials < 1
        ):
            raise ValueError(
                f"Invalid value for argument `parallel_trials`: got {parallel_trials!r}. "
                "Expected a positive integer (trials running at once), or None."
            )
        object.__setattr__(self, "oracle", oracle)
        object.__setattr__(self, "parallel_trials", parallel_trials)
        object.__setattr__(self, "fatal_error", None)
        lock = threading.RLock()
        object.__setattr__(self, "_lock", lock)
        object.__setattr__(self, "_trial_ended", threading.Condition(lock))
        object.__setattr__(self, "_started", {})
        object.__setattr__(self, "_restarts", {})
        # KerasTuner writes its state with a plain open/write; a kill mid-write leaves a
        # truncated file that the next run cannot reload. Route the writes through
        # write-to-temporary-and-rename.
        oracle.save = self._save_state
        _upstream.replace_save_trial(oracle, self._save_trial_state)
        proposing = oracle.populate_space
        oracle.populate_space = lambda trial_id: self._distinct_from_running(proposing, trial_id)

    # Delegation --------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "oracle"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self.oracle, name, value)

    @property
    def verbose(self) -> Any:
        return self.oracle.verbose

    @verbose.setter
    def verbose(self, value: Any) -> None:
        self.oracle.verbose = value

    @property
    def _project_dir(self) -> str:
        return _upstream.oracle_project_dir(self.oracle)

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Calls a method of the wrapped oracle under the lock, never leaking KerasTuner's."""
        with self._lock:
            try:
                return method(*args, **kwargs)
            finally:
                self._release_keras_tuner_lock()

    def _release_keras_tuner_lock(self) -> None:
        # `@synchronized` leaves its lock held (and this thread's name recorded as holder)
        # when the wrapped method raises. Our lock serializes every caller, so a lock still
        # recorded for this thread after the call returned can only be a leaked one.
        _upstream.release_oracle_lock(self.oracle, threading.current_thread().name)

    # Trials ------------------------------------------------------------------------------

    def create_trial(self, tuner_id: str) -> Trial:
        """Returns a trial for `tuner_id`: RUNNING, IDLE (ask again later) or STOPPED.

        Args:
            tuner_id: the id of the tuner slot asking; each running trial has its own.

        Returns:
            A `keras_tuner.engine.trial.Trial`: STOPPED once the wrapped oracle raised in
            `end_trial` (`fatal_error`), so that the trials running then end and no new
            one begins.
        """
        with self._lock:
            if self.fatal_error is not None:
                return trial_module.Trial(self.oracle.get_space(), status=TrialStatus.STOPPED)
            ongoing = self.oracle.ongoing_trials
            if (
                self.parallel_trials is not None
                and tuner_id not in ongoing
                and len(ongoing) >= self.parallel_trials
            ):
                return trial_module.Trial(self.oracle.get_space(), status=TrialStatus.IDLE)
            trial = self._call(self.oracle.create_trial, tuner_id)
            if trial.status == TrialStatus.RUNNING:
                self._started.setdefault(trial.trial_id, time.monotonic())
            return trial

    def wait_for_trial(self, tuner_id: str, timeout: float | None = None) -> Trial:
        """Like `create_trial`, but while the oracle answers IDLE, waits for a trial to end.

        Args:
            tuner_id: the id of the tuner slot asking.
            timeout: seconds to wait at most, or `None` to wait as long as trials are
                running. Defaults to `None`.

        Returns:
            A RUNNING or STOPPED trial, or an IDLE one when `timeout` passed first (or when
            the oracle is IDLE with no trial running, which no trial end can change).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._trial_ended:
            while True:
                trial = self.create_trial(tuner_id)
                if trial.status != TrialStatus.IDLE or not self.oracle.ongoing_trials:
                    return trial
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return trial
                self._trial_ended.wait(remaining)

    def update_trial(self, trial_id: str, metrics: dict[str, float], step: int = 0) -> Trial:
        """Records `metrics` of trial `trial_id` at `step` (an epoch)."""
        return self._call(self.oracle.update_trial, trial_id, metrics, step=step)

    def end_trial(self, trial: Trial) -> None:
        """Ends `trial` (COMPLETED, INVALID or FAILED) and logs one line about it.

        The trial is taken off the running trials and the state saved even when the
        wrapped oracle raises (for instance on too many consecutive failed trials); the
        error is then re-raised and kept in `fatal_error`.
        """
        with self._trial_ended:
            try:
                self._call(self.oracle.end_trial, trial)
            except Exception as e:
                self.fatal_error = e
                if trial.trial_id in self.oracle.trials:
                    self._save_trial_state(self.oracle.trials[trial.trial_id])
                raise
            finally:
                # KerasTuner saves before it forgets the running trial; save after.
                self._forget_ongoing(trial.trial_id)
                self._save_state()
                self._trial_ended.notify_all()
            self._log_end(self.oracle.trials[trial.trial_id])

    def requeue(self, tuner_id: str, reason: str, max_restarts: int = 2) -> str | None:
        """Puts the trial running under `tuner_id` back in the queue (its worker died).

        A trial whose workers died more than `max_restarts` times is ended as FAILED
        instead, so that a trial that kills its process cannot stall the search.

        Args:
            tuner_id: the tuner id whose trial was interrupted.
            reason: why, for the log and the failed trial's message.
            max_restarts: restarts allowed per trial. Defaults to `2`.

        Returns:
            The interrupted trial's id, or `None` when `tuner_id` had no running trial.
        """
        with self._trial_ended:
            trial = self.oracle.ongoing_trials.get(tuner_id)
            if trial is None:
                return None
            restarts = self._restarts
            restarts[trial.trial_id] = restarts.get(trial.trial_id, 0) + 1
            if restarts[trial.trial_id] > max_restarts:
                trial.status = TrialStatus.FAILED
                trial.message = f"{reason}; gave up after {max_restarts} restarts."
                logger.warning("Trial %s failed: %s", trial.trial_id, trial.message)
                self.end_trial(trial)
                return trial.trial_id
            self.oracle.ongoing_trials.pop(tuner_id)
            _upstream.retry_queue(self.oracle).append(trial.trial_id)
            self._started.pop(trial.trial_id, None)
            self._save_state()
            logger.warning("Trial %s interrupted (%s); it will run again.", trial.trial_id, reason)
            self._trial_ended.notify_all()
            return trial.trial_id

    def release(self, tuner_id: str) -> None:
        """Forgets a tuner id that will ask for no more trials (a worker that gave up)."""
        with self._trial_ended:
            self.oracle.tuner_ids.discard(tuner_id)
            self._trial_ended.notify_all()

    def _forget_ongoing(self, trial_id: str) -> None:
        ongoing = self.oracle.ongoing_trials
        for tuner_id, running in list(ongoing.items()):
            if running.trial_id == trial_id:
                ongoing.pop(tuner_id)

    def _log_end(self, trial: Trial) -> None:
        started = self._started.pop(trial.trial_id, None)
        elapsed = "" if started is None else f" in {time.monotonic() - started:.1f} s"
        values = {k: v for k, v in trial.hyperparameters.values.items() if k != "tuner/trial_id"}
        score = "none" if trial.score is None else f"{trial.score:.6g}"
        logger.info(
            "Trial %s %s%s: score %s, hyperparameters %s",
            trial.trial_id,
            trial.status,
            elapsed,
            score,
            values,
        )

    # Plain delegation (under the lock) ---------------------------------------------------

    def populate_space(self, trial_id: str) -> dict:
        return self._call(self.oracle.populate_space, trial_id)

    def _distinct_from_running(self, proposing: Any, trial_id: str) -> dict:
        """The wrapped oracle's proposal for `trial_id`, never the values of a running trial.

        KerasTuner's oracles decide from ended trials; with K trials in flight a model-based
        one (BayesianOptimization) can propose values a running trial already trains, which
        wastes a slot. Such a proposal is asked again (`PROPOSALS` times in all), then
        replaced by values drawn at random among those never handed out."""
        for _ in range(PROPOSALS):
            response = proposing(trial_id)
            running = self._running_with(response)
            if running is None:
                return response
            logger.info(
                "Trial %s: the oracle proposed the hyperparameters of running trial %s; "
                "asking again.",
                trial_id,
                running,
            )
        values = _upstream.random_unseen_values(self.oracle)
        if values is None:
            return {"status": TrialStatus.STOPPED, "values": None}
        logger.info("Trial %s: drawn at random, not to repeat a running trial.", trial_id)
        return {"status": TrialStatus.RUNNING, "values": values}

    def _running_with(self, response: dict) -> str | None:
        """The id of a running trial with the proposal's values, if any."""
        if response.get("status") != TrialStatus.RUNNING:
            return None
        values = response.get("values") or {}
        for trial in self.oracle.ongoing_trials.values():
            if trial.hyperparameters.values == values:
                return trial.trial_id
        return None

    def score_trial(self, trial: Trial) -> None:
        self._call(self.oracle.score_trial, trial)

    def get_space(self) -> Any:
        return self._call(self.oracle.get_space)

    def update_space(self, hyperparameters: Any) -> None:
        self._call(self.oracle.update_space, hyperparameters)

    def get_trial(self, trial_id: str) -> Trial:
        return self._call(self.oracle.get_trial, trial_id)

    def get_best_trials(self, num_trials: int = 1) -> list[Trial]:
        return self._call(self.oracle.get_best_trials, num_trials)

    def remaining_trials(self) -> int | None:
        return self._call(self.oracle.remaining_trials)

    def get_state(self) -> dict:
        return self._call(self.oracle.get_state)

    def set_state(self, state: dict) -> None:
        self._call(self.oracle.set_state, state)

    def _set_project_dir(self, directory: str, project_name: str) -> None:
        _upstream.set_oracle_project_dir(self.oracle, directory, project_name)

    def _get_oracle_fname(self) -> str:
        return _upstream.oracle_file(self.oracle)

    def _get_trial_dir(self, trial_id: str) -> str:
        return _upstream.trial_dir(self.oracle, trial_id)

    # State -------------------------------------------------------------------------------

    def save(self) -> None:
        """Writes the oracle's state (`oracle.json`) atomically."""
        with self._lock:
            self._save_state()

    def _save_state(self) -> None:
        state = self.oracle.get_state()
        state["kg_restarts"] = dict(self._restarts)
        _state.write_json(_upstream.oracle_file(self.oracle), state)

    def _save_trial_state(self, trial: Trial) -> None:
        path = os.path.join(_upstream.trial_dir(self.oracle, trial.trial_id), "trial.json")
        _state.write_json(path, trial.get_state())

    def reload(self) -> None:
        """Reloads the project's state and repairs what a crash may have left half written.

        A trial recorded as finished is never queued again; a trial recorded as running
        (including one created just before the crash, before the oracle's own state was
        written) is queued to run again.
        """
        with self._lock:
            self._call(self.oracle.reload)
            state = _upstream.kt_load_json(_upstream.oracle_file(self.oracle))
            self._restarts = dict(state.get("kg_restarts", {}))
            self._repair()
            self._save_state()

    def _repair(self) -> None:
        oracle = self.oracle
        trials = oracle.trials
        queue: list[str] = []
        for trial_id in _upstream.retry_queue(oracle):
            if trials[trial_id].status not in _ENDED and trial_id not in queue:
                queue.append(trial_id)
        for trial_id in sorted(trials):
            trial = trials[trial_id]
            if trial.status in _ENDED:
                if trial_id not in oracle.end_order:
                    oracle.end_order.append(trial_id)
                    run_times = _upstream.run_times(oracle)
                    run_times[trial_id] = max(run_times[trial_id], 1)
                continue
            if trial.status in (TrialStatus.RUNNING, TrialStatus.IDLE) and trial_id not in queue:
                queue.append(trial_id)
            if trial_id not in oracle.start_order:
                oracle.start_order.append(trial_id)
        repaired = [t for t in queue if t not in _upstream.retry_queue(oracle)]
        if repaired:
            logger.info("Resuming: trials %s were interrupted and will run again.", repaired)
        _upstream.set_retry_queue(oracle, queue)


def _wrappable(oracle: Any) -> bool:
    return isinstance(oracle, keras_tuner.Oracle) and not isinstance(oracle, ParallelOracle)


_WRAPPERS: dict[type, type] = {}


def _wrapper_class(oracle_class: type) -> type:
    """`ParallelOracle` subclassing `oracle_class` too (made once per class): methods and
    attributes still resolve through `ParallelOracle` first, then to the wrapped instance."""
    if oracle_class is keras_tuner.Oracle:
        return ParallelOracle
    if oracle_class not in _WRAPPERS:
        name = f"Parallel{oracle_class.__name__}"
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": ParallelOracle.__doc__,
        }
        _WRAPPERS[oracle_class] = type(name, (ParallelOracle, oracle_class), namespace)
    return _WRAPPERS[oracle_class]
