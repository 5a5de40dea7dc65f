"""`ParallelTuner`: KerasTuner trials K at a time on one GPU, as ModelPacks or processes."""

from __future__ import annotations

import logging
import os
import time
import traceback
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras
import keras_tuner
from keras_tuner import errors

from keras_gpushare import _upstream
from keras_gpushare.tuner import _devices, _state
from keras_gpushare.tuner._data_orders import built
from keras_gpushare.tuner._executor import AloneFallback, Executor, TrialCalls, TrialFeed
from keras_gpushare.tuner._search_ledger import SearchLedger
from keras_gpushare.tuner.oracle import ParallelOracle

logger = logging.getLogger("keras_gpushare.tuner")

if TYPE_CHECKING:
    from keras_tuner.engine.trial import Trial

trial_module = _upstream.kt_trial_module()
TrialStatus = trial_module.TrialStatus
_EXECUTORS = ("auto", "pack", "slots", "processes")
# Arguments of KerasTuner's built-in tuners (RandomSearch, ...) that configure the oracle.
_ORACLE_ARGUMENTS = (
    "hyperparameters",
    "tune_new_entries",
    "allow_new_entries",
    "max_retries_per_trial",
    "max_consecutive_failed_trials",
)
# Set by the processes executor in its worker processes (see `_process_executor`).
WORKER_ENV = "KERAS_GPUSHARE_TUNER_WORKER"
# Set by a worker process while it imports the user's script to find the hypermodel there.
IMPORTING_MAIN_ENV = "KERAS_GPUSHARE_TUNER_IMPORTING_MAIN"
STOP_IMPORT_CODE = 79
_REMOTE_IDLE_WAIT_S = 1.0  # pause before a remote worker asks an IDLE chief again


class ParallelTuner(keras_tuner.Tuner):
    """A KerasTuner `Tuner` that runs `parallel_trials` trials at once on one device.

    With `executor="pack"`, each round of up to K trials is built by the hypermodel and
    trained together as `ModelPack`s (one per batch size; same-architecture trials in their
    own pack so they can be fused). With `executions_per_trial=E`, each trial's E
    executions are members of the pack too. Each trial is then scored, checkpointed and
    ended exactly as KerasTuner's `Tuner.run_trial` would: its callbacks see its own model
    and figures, a callback that stops "its" model stops only that member, a trial that
    raises fails alone (INVALID, retried up to `max_retries_per_trial` times, or FAILED),
    and a `keras_tuner.errors.FatalError` ends the search after the round's other trials
    are recorded.

    Trials that KerasTuner's own code must run (a subclass overriding `run_trial` or
    `_build_and_fit_model`, a hypermodel overriding `HyperModel.fit`, a
    `distribution_strategy`) run one at a time in this process with the pack executor, as
    in KerasTuner; the processes executor runs them in parallel. So does, after the round's
    packs, a trial whose model trains itself (overrides `fit`, `train_step`, `test_step`
    or `compute_loss`) or whose own pack raises.

    With `executor="slots"`, the packs are kept for the search ("programs") and trials are
    streamed through their slots: a slot freed by a trial that ended takes the next trial
    that fits it (its widths, activations, depth, dropout rates and optimizer held as data)
    without a new trace or compile. The default, `executor="auto"`, is `"slots"` on JAX and
    `"pack"` on TensorFlow and torch.

    With `executor="processes"`, K worker processes share the device (each calls
    `kg.share_gpu`) and take trials from a chief in this process over KerasTuner's own
    gRPC protocol on 127.0.0.1; each worker rebuilds this tuner (your subclass, with your
    arguments) and runs one trial at a time with KerasTuner's `run_trial`; a worker that
    dies is restarted and its trial run again. Workers on other machines can join the same
    chief (see `docs/tuner.md`).

    Everything else is KerasTuner's: the oracles, `search`, `results_summary`,
    `get_best_models`, `get_best_hyperparameters` and the project folder. A search that is
    killed at any moment and started again with `overwrite=False` finishes with exactly
    `max_trials` trials, none lost and none run twice. `trial_paths()` says how each trial
    was trained (in which pack and fused group, on the graph engine, or alone, and why),
    and `results_summary` adds it to each trial's block.

    Args:
        hypermodel: a `keras_tuner.HyperModel` or a function `build(hp)` returning a
            compiled `keras.Model`. A hyperparameter named `"batch_size"` sets a trial's
            batch size. Optional only in a subclass that overrides `run_trial`. Defaults
            to `None`.
        oracle: a `keras_tuner.Oracle` (RandomSearch, BayesianOptimization, Hyperband,
            GridSearch, ...); `None` makes a `RandomSearchOracle` from `objective`,
            `max_trials`, `seed` and the other oracle arguments below. Defaults to `None`.
        objective: the objective for the default oracle: a metric name such as
            `"val_loss"`, a `keras_tuner.Objective`, or a list of them (multi-objective).
            Defaults to `None`.
        max_trials: trials in all, for the default oracle. Defaults to `None` (10).
        parallel_trials: trials running at once (pack size or worker count). Defaults to
            `4`.
        executor: `"pack"`, `"slots"` (trials streamed through the slots of packs kept
            for the search, refilled in place as trials end), `"processes"`, or `"auto"`:
            `"slots"` on JAX, where each new pack's XLA compile is what a search waits for,
            `"pack"` on TensorFlow and torch. Defaults to `"auto"`.
        fuse: passed to `ModelPack` (`"auto"`, `True`, `False`). Defaults to `"auto"`.
        seed: seed of the default oracle. Defaults to `None`.
        memory_limit_mb: with `executor="processes"` or `devices` on a GPU, each worker's
            memory cap in MiB (`kg.share_gpu(memory_limit_mb=...)`); `None` turns on memory
            growth instead. Defaults to `None`.
        devices: `None` (this process trains the trials, on its first GPU), `"all"` (every
            GPU of this machine that `CUDA_VISIBLE_DEVICES` shows, or all of them), or a
            list of GPU indices or UUIDs: one worker process per entry, pinned to its GPU
            (`CUDA_VISIBLE_DEVICES`) before its framework starts, each training
            `parallel_trials` trials at a time with `executor`, coordinated by KerasTuner's
            chief/worker protocol on localhost (the chief runs in `search`). A GPU is named
            by its index (`0` or `"gpu0"`, its worker's name) or its UUID (or a unique
            prefix), checked against the GPUs NVML lists before any worker starts: an
            entry naming none is a `ValueError`; on a machine without GPUs, the workers
            train on the CPU, with a warning unless the entries name CPU workers
            (`devices=["cpu0", "cpu1"]`). Not with `executor="processes"`. Defaults to
            `None`.
        directory: the folder holding projects. Defaults to `None` (the current folder).
        project_name: the project's folder name. Defaults to `None` ("untitled_project").
        overwrite: start afresh instead of resuming the project. Defaults to `False`.
        **kwargs: the default oracle's other arguments, as `keras_tuner.RandomSearch` takes
            them (`hyperparameters`, `tune_new_entries`, `allow_new_entries`,
            `max_retries_per_trial`, `max_consecutive_failed_trials`), and the other
            `keras_tuner.Tuner` arguments (`max_model_size`, `optimizer`, `loss`,
            `metrics`, `executions_per_trial`, `distribution_strategy`, `tuner_id`).

    Example:

    ```python
    import numpy as np
    import keras
    import keras_gpushare as kg

    def build(hp):
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(hp.Choice("units", [8, 16]), activation="relu"),
            keras.layers.Dense(1),
        ])
        model.compile(keras.optimizers.Adam(hp.Float("lr", 1e-3, 1e-1, sampling="log")), "mse")
        return model

    x = np.random.rand(256, 8).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    tuner = kg.tuner.ParallelTuner(
        build, objective="val_loss", max_trials=4, parallel_trials=4, seed=1,
        directory="/tmp/kg_tuner_doc", project_name="example", overwrite=True,
    )
    tuner.search(x, y, epochs=2, validation_split=0.25)
    best_hp = tuner.get_best_hyperparameters()[0]
    ```
    """

    _init_call: tuple[tuple, dict[str, Any]]  # the arguments it was made with (`__new__`)

    def __new__(cls, *args: Any, **kwargs: Any) -> ParallelTuner:
        tuner = super().__new__(cls)
        # The processes executor's workers rebuild this tuner, subclass included, from the
        # arguments it was made with.
        tuner._init_call = (args, dict(kwargs))
        return tuner

    def __init__(
        self,
        hypermodel: Any = None,
        oracle: keras_tuner.Oracle | None = None,
        objective: Any = None,
        max_trials: int | None = None,
        parallel_trials: int = 4,
        executor: str = "auto",
        fuse: str | bool = "auto",
        seed: int | None = None,
        memory_limit_mb: int | None = None,
        devices: str | Sequence[str | int] | None = None,
        directory: str | None = None,
        project_name: str | None = None,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_arguments(parallel_trials, executor, fuse, memory_limit_mb)
        devices = _checked_devices(devices, executor)
        if hypermodel is None and _overrides(type(self), "run_trial") is None:
            # KerasTuner's own check; ParallelTuner overrides `run_trial`, which hides it.
            raise ValueError(
                "Received `hypermodel=None`. We only allow not specifying "
                "`hypermodel` if the user defines the search space in "
                "`Tuner.run_trial()` by subclassing a `Tuner` class without "
                "using a `HyperModel` instance."
            )
        if oracle is not None and not isinstance(oracle, keras_tuner.Oracle):
            # KerasTuner's own error (BaseTuner's), raised before any work.
            raise ValueError(
                "Expected `oracle` argument to be an instance of `Oracle`. "
                f"Received: oracle={oracle} (of type ({type(oracle)})."
            )
        oracle_kwargs = {k: kwargs.pop(k) for k in _ORACLE_ARGUMENTS if k in kwargs}
        if oracle is None:
            oracle = keras_tuner.oracles.RandomSearchOracle(
                objective=objective,
                max_trials=10 if max_trials is None else max_trials,
                seed=seed,
                **oracle_kwargs,
            )
        elif objective is not None or max_trials is not None or seed is not None or oracle_kwargs:
            default_oracle_args = {"objective": objective, "max_trials": max_trials, "seed": seed}
            given = [k for k, v in default_oracle_args.items() if v is not None]
            given += list(oracle_kwargs)
            raise ValueError(
                f"Invalid arguments: got an `oracle` together with {sorted(given)}. These "
                "set up the default oracle only; pass them to your oracle instead, e.g. "
                "`RandomSearchOracle(objective='val_loss', max_trials=20, seed=1)`."
            )
        if os.environ.get(WORKER_ENV):
            # A worker process never wipes the chief's project, and keeps the id it was given.
            overwrite = False
            kwargs.pop("tuner_id", None)
        self.parallel_trials = parallel_trials
        self.executor = _resolved_executor(executor)
        self.fuse = fuse
        self.memory_limit_mb = memory_limit_mb
        self.devices = devices
        # Filled by `set_state` when KerasTuner's `__init__` reloads the project.
        self._trial_paths: dict[str, dict[str, str]] = {}
        super().__init__(
            # No cap on running trials in the oracle itself: each round asks for K trials,
            # and a caller of `tuner.oracle` (KerasTuner's distributed workers, say) gets
            # what the wrapped oracle would give it.
            oracle=ParallelOracle(oracle),
            hypermodel=hypermodel,
            directory=directory,
            project_name=project_name,
            overwrite=overwrite,
            **kwargs,
        )
        # Models `_declare` built for trials, taken by the executor: {id(hp): (hp, models)}.
        self._built: dict[int, tuple] = {}
        # The random generators' state each trial model's build left (`_data_orders`).
        self._build_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # What the in-process executors compile and compute, for the search's log.
        self._ledger = SearchLedger()
        self._executor = self._make_executor(self.executor)

    def _make_executor(self, executor: str) -> Executor:
        """The executor named `executor`: the one place that reads the argument.

        KerasTuner's chief (`KERASTUNER_TUNER_ID=chief`) of an executor that trains trials
        in its own process only serves the oracle, as KerasTuner's chief does: it is the
        processes executor's chief with no local worker.
        """
        from keras_gpushare.tuner._process_executor import ProcessExecutor, WorkerLaunch
        from keras_gpushare.tuner._program_executor import ProgramExecutor

        args, kwargs = self._init_call

        def processes(count: int, devices: tuple[str, ...] = ()) -> Executor:
            launch = WorkerLaunch(count, self.memory_limit_mb, type(self), args, kwargs, devices)
            return ProcessExecutor(self.oracle, self.tuner_id, launch)

        if self.devices is not None and not os.environ.get(WORKER_ENV):
            # The chief of one worker per device; each worker (this tuner rebuilt there)
            # streams its trials through its own executor, below.
            entries = _devices.device_entries(self.devices)
            return processes(len(entries), entries)
        if _upstream.is_chief_oracle() and executor != "processes":
            return processes(0)
        if executor == "processes":
            return processes(self.parallel_trials)
        # "slots": programs that refill their slots; "pack": programs of a round's trials.
        programs = ProgramExecutor(self._trial_calls(), refills=executor == "slots")
        return AloneFallback(programs, self._runs_alone)

    def _trial_calls(self) -> TrialCalls:
        """What an executor training trials in this process needs from this tuner."""
        hooks = ("on_epoch_begin", "on_epoch_end", "on_batch_begin", "on_batch_end")
        return TrialCalls(
            objective=self.oracle.objective,
            executions_per_trial=self.executions_per_trial,
            fuse=self.fuse,
            build_model=self._take_built_model,
            run_alone=lambda trial, *args, **kwargs: self.run_trial(trial, *args, **kwargs),
            copy_callbacks=lambda callbacks: _upstream.copy_callbacks(self, callbacks),
            configure_tensorboard=lambda callbacks, trial, execution: (
                _upstream.configure_tensorboard_dir(self, callbacks, trial, execution)
            ),
            checkpoint_file=lambda trial_id: _upstream.checkpoint_file(self, trial_id),
            save_build_config=self._save_build_config,
            build_state=self._build_states.get,
            ledger=self._ledger,
            space=self._space,
            batch_hooks=any(_overrides(type(self), n) for n in hooks[2:]),
            epoch_end_hook=_overrides(type(self), "on_epoch_end") is not None,
            **{name: self._hook(name) for name in hooks},
        )

    def _space(self) -> Any:
        """A copy of the oracle's search space, or `None` where this oracle (a remote
        chief's client) has none to give."""
        get_space = getattr(self.oracle, "get_space", None)
        return None if get_space is None else get_space()

    def _hook(self, name: str) -> Any:
        """Calls this tuner's hook `name` as it is when called (an instance may replace it)."""
        return lambda *args, **kwargs: getattr(self, name)(*args, **kwargs)

    # Search ------------------------------------------------------------------------------

    def search(self, *fit_args: Any, **fit_kwargs: Any) -> None:
        """Runs the search; takes the arguments of `model.fit` (data, epochs, callbacks...).

        Args:
            *fit_args: positional arguments of `fit`, e.g. `x, y`.
            **fit_kwargs: keyword arguments of `fit`, e.g. `epochs=10,
                validation_data=(x_val, y_val), callbacks=[...]`. Callbacks must be
                deep-copyable (each trial gets its own copy).
        """
        if os.environ.get(IMPORTING_MAIN_ENV):
            # A worker process is importing the user's script to find the hypermodel and
            # reached the script's own search: everything it needs is defined by now.
            raise SystemExit(STOP_IMPORT_CODE)
        if "verbose" in fit_kwargs and (
            not _upstream.has_chief_oracle() or _upstream.is_chief_oracle()
        ):
            self.oracle.verbose = fit_kwargs["verbose"]
        remote = _upstream.is_worker(self)
        if remote:
            from keras_gpushare.tuner import _process_executor

            # Trials travel whole (message, hyperparameters in order) to a chief of this package.
            self.oracle: Any = _process_executor.chief_client(self.oracle)
        else:
            # Write the project state before any trial exists, so that a run killed from
            # here on is always resumed (KerasTuner reloads only when the tuner file exists).
            self.save()
        self.on_search_begin()
        self._ledger.reset()
        self._executor.run(self._feed(remote), fit_args, fit_kwargs)
        summary = self._ledger.summary()
        if summary is not None:
            logger.info(summary)
        self.on_search_end()

    def _feed(self, remote: bool) -> TrialFeed:
        """The executor's trials: from this tuner's oracle, or from a chief if `remote`."""
        return TrialFeed(
            slots=self.parallel_trials,
            next_trials=lambda slots, running=False: self._next_trials(slots, remote, running),
            end_trials=self._end_round,
            remote=remote,
            one_at_a_time=lambda path, fit_args, fit_kwargs: self._search_one_at_a_time(
                path, fit_args, fit_kwargs, remote
            ),
            record_ended=self._record_ended,
            remaining_trials=(lambda: None) if remote else self.oracle.remaining_trials,
        )

    def _runs_alone(self) -> str | None:
        """Why this tuner's trials must run one at a time through KerasTuner's code, if so."""
        reasons = []
        for method in ("run_trial", "_build_and_fit_model"):
            owner = _overrides(type(self), method)
            if owner is not None:
                reasons.append(f"{owner.__name__} overrides `{method}`")
            elif method in vars(self):
                reasons.append(f"this tuner's `{method}` is replaced")
        if self.hypermodel is not None and type(self.hypermodel).fit is not (
            keras_tuner.HyperModel.fit
        ):
            reasons.append(f"{type(self.hypermodel).__name__} overrides `HyperModel.fit`")
        if self.distribution_strategy is not None:
            reasons.append("a `distribution_strategy` is set")
        if not reasons:
            return None
        reason = "; ".join(reasons)
        if not getattr(self, "_warned_alone", False):
            self._warned_alone = True
            message = (
                f"ParallelTuner runs each trial alone, one at a time, as KerasTuner does, "
                f"because {reason}: such trials cannot train together in one pack. Use "
                'executor="processes" to run them in parallel, or tune the batch size with '
                'a hyperparameter named "batch_size" instead of overriding `fit`.'
            )
            warnings.warn(message, stacklevel=4)
            logger.warning(message)
        return reason

    def _search_one_at_a_time(
        self, path: dict[str, str], fit_args: tuple, fit_kwargs: dict, remote: bool
    ) -> None:
        """KerasTuner's own loop, waiting instead of spinning while the oracle is IDLE."""
        while True:
            self.pre_create_trial()
            trial = self.oracle.create_trial(self.tuner_id)
            if trial.status == TrialStatus.STOPPED:
                break
            if trial.status == TrialStatus.IDLE:
                if not remote:
                    _warn_idle()
                    break
                time.sleep(_REMOTE_IDLE_WAIT_S)
                continue
            self.on_trial_begin(trial)
            self._record_path(trial.trial_id, path)
            _upstream.run_and_update_trial(self, trial, *fit_args, **fit_kwargs)
            self.on_trial_end(trial)

    def _next_trials(self, slots: Any, remote: bool, running: bool = False) -> list:
        """A trial for each slot the oracle has one for, begun; `[]` when the search is over.

        With some of its trials `running` (begun and not ended, whether training or waiting
        to), an IDLE answer is `[]`: none until one ends. A remote worker must not wait
        then: the oracle may be waiting for those very trials (GridSearch, Hyperband), and
        the chief's CreateTrial already holds an IDLE answer a moment. With none running,
        a remote worker waits (its chief's other workers end trials); this process's own
        search ends, as no trial end can change the answer.
        """
        tuner_ids = [f"{self.tuner_id}-{i}" for i in slots]
        while True:
            trials, stopped = self._next_round(tuner_ids)
            if trials:
                for trial in trials:
                    self.on_trial_begin(trial)
                return trials
            if stopped or running:
                return []
            if not remote:
                _warn_idle()
                return []
            time.sleep(_REMOTE_IDLE_WAIT_S)

    def _next_round(self, slots: list[str]) -> tuple[list, bool]:
        """Up to one trial per slot; whether the oracle answered STOPPED to every slot.

        Every slot asks, even after a STOPPED answer, so that each of them is told to stop
        (a distributed chief waits for every tuner id it has seen to be told).
        """
        trials, stopped = [], True
        for slot in slots:
            self.pre_create_trial()
            trial = self.oracle.create_trial(slot)
            if trial.status == TrialStatus.RUNNING:
                self._declare(trial)
                trials.append(trial)
            if trial.status != TrialStatus.STOPPED:
                stopped = False
        return trials, stopped

    def _end_round(self, trials: list, outcomes: dict) -> None:
        """Records and ends each trial as `BaseTuner._try_run_and_update_trial` would.

        A `FatalError` (or an error the oracle raises while ending a trial, such as too
        many consecutive failures) is raised once the round's other trials are ended.
        """
        error = None
        for trial in trials:
            try:
                self._record_outcome(trial, outcomes[trial.trial_id])
            except errors.FatalError as e:
                error = error or e
                continue
            try:
                self.on_trial_end(trial)
            except Exception as e:
                error = error or e
        if error is not None:
            raise error

    def _record_outcome(self, trial: Trial, outcome: Any) -> None:
        if outcome.path is not None:
            self._record_path(trial.trial_id, outcome.path)
        try:
            if outcome.error is not None:
                raise outcome.error
            results = outcome.results
            _upstream.validate_trial_results(results, self.oracle.objective, "Tuner.run_trial()")
            self.oracle.update_trial(
                trial.trial_id,
                _upstream.metrics_dict(results, self.oracle.objective),
                step=_upstream.best_step(results, self.oracle.objective),
            )
            trial.status = TrialStatus.COMPLETED
        except Exception as e:
            if isinstance(e, errors.FatalError):
                raise
            if _upstream.kt_debug():
                traceback.print_exc()
            failed = isinstance(e, errors.FailedTrialError)
            trial.status = TrialStatus.FAILED if failed else TrialStatus.INVALID
            trial.message = traceback.format_exc()
            logger.warning("Trial %s: %s: %s", trial.trial_id, type(e).__name__, e)

    # Building ----------------------------------------------------------------------------

    def _declare(self, trial: Trial) -> None:
        """Builds `trial`'s models now, before the next trial is made, and adds the
        hyperparameters their building declared (`units_2` of a third layer, say) to the
        oracle's space.

        KerasTuner's own loop ends a trial (and so updates the space) before it makes the
        next, so each trial is drawn from a space that knows what the trials before it
        declared; trials made several at a time are drawn from the same space that way.
        The executor takes the models built here (`build_model`), in the same order, so
        nothing is built twice; an error is raised again when it asks.
        """
        hp = trial.hyperparameters
        models: list = []
        try:
            for _ in range(self.executions_per_trial):
                models.append(self._build_trial_model(hp))
        except Exception as e:
            models.append(e)
        self._built[id(hp)] = (hp, models)
        if getattr(self.oracle, "allow_new_entries", True):
            self.oracle.update_space(hp)

    def _take_built_model(self, hp: Any) -> keras.Model:
        """The next model `_declare` built for `hp`, or a new one."""
        _, models = self._built.get(id(hp), (None, []))
        if not models:
            return self._build_trial_model(hp)
        model = models.pop(0)
        if not models:
            del self._built[id(hp)]
        if isinstance(model, Exception):
            raise model
        return model

    def _build_trial_model(self, hp: Any) -> keras.Model:
        """`Tuner._try_build` without `clear_session` (the round's other models live on)."""
        model, state = built(lambda: self._build_hypermodel(hp))
        if not isinstance(model, keras.Model):
            raise errors.FatalTypeError(
                "Expected the model-building function, or HyperModel.build() to return a "
                f"valid Keras Model instance. Received: {model} of type {type(model)}."
            )
        self._build_states[model] = state
        size = _upstream.model_size(model)
        if self.max_model_size and size > self.max_model_size:
            raise errors.FailedTrialError(f"Oversized model: {size} parameters. Skip model.")
        return model

    def _build_hypermodel(self, hp: Any) -> keras.Model:
        model = _upstream.kt_build_hypermodel(super(), hp)
        # Hyperband: a trial promoted to the next round starts from its parent's weights.
        parent = hp.values.get("tuner/trial_id")
        if parent is not None:
            if not model.built:
                model.build_from_config(
                    _upstream.kt_load_json(_upstream.build_config_file(self, parent))
                )
            model.load_weights(_upstream.checkpoint_file(self, parent))
        return model

    def run_trial(self, trial: Trial, *fit_args: Any, **fit_kwargs: Any) -> Any:
        """Runs one trial alone with KerasTuner's `Tuner.run_trial`, honouring Hyperband.

        Used for trials that run one at a time (worker processes, `run_trial` or
        `HyperModel.fit` overrides); a subclass may override it as in KerasTuner.
        """
        values = trial.hyperparameters.values
        if "tuner/epochs" in values:
            fit_kwargs["epochs"] = values["tuner/epochs"]
            fit_kwargs["initial_epoch"] = values["tuner/initial_epoch"]
        plain_fit = type(self.hypermodel).fit is keras_tuner.HyperModel.fit
        if "batch_size" in values and plain_fit:
            fit_kwargs["batch_size"] = values["batch_size"]
        return super().run_trial(trial, *fit_args, **fit_kwargs)

    def _save_build_config(self, trial_id: str, model: keras.Model) -> None:
        _state.write_json(_upstream.build_config_file(self, trial_id), model.get_build_config())

    # Paths -------------------------------------------------------------------------------

    def trial_paths(self) -> dict[str, dict[str, str]]:
        """How each trial was trained, and why: `{trial_id: path}`, by trial id.

        Each path is a dict of short sentences, JSON-serialisable and kept in the tuner's
        state, so a resumed search still reports the trials of earlier runs:

        - `"path"`: `"slot"` (in a slot of a compiled program, `executor="slots"`),
          `"fused"` (in a `ModelPack`, in a fused group with other trials),
          `"graph"` (in a `ModelPack`, on the graph engine), `"mixed"` (some executions
          fused, some on the graph engine), `"alone"` (with KerasTuner's own `run_trial`),
          `"worker"` (in a worker process, `executor="processes"`) or `"not trained"`
          (building its model raised).
        - `"worker"`: the worker process that trained it (its KerasTuner tuner id: `gpu1`
          for the worker of GPU 1 with `devices`), when a worker reported its path.
        - `"why"`: the reason: the pack's planner's for `"fused"` and `"graph"` (padding,
          or why the model did not fuse), what made the trial run alone (its model
          overrides `train_step`, its pack raised, the tuner overrides `run_trial`, ...).
        - `"pack"`: the trials of its pack and their batch size (`"fused"`, `"graph"`,
          `"mixed"`).
        - `"group"`: its fused group and the other trials in it (`"fused"`, `"mixed"`).
        - `"program"` and `"slot"`: the number of the compiled program the trial trained in
          and its slot there (`"slot"`).
        - `"split"`: only when a program (a round's pack, or a slots program) of several
          trials raised and each of its trials was then given a program alone to find the
          culprit: that program and its error.

        A trial run again (a retried INVALID trial, or one interrupted and resumed) shows
        its last run. Trials that ran in another process report no path there: a chief
        records `"worker"` for them when its search ends.

        Returns:
            A dict of trial ids to paths; trials without a recorded path are left out.

        Example:

        ```python
        import numpy as np
        import keras
        import keras_gpushare as kg

        def build(hp):
            model = keras.Sequential([
                keras.Input((4,)),
                keras.layers.Dense(hp.Choice("units", [4, 8]), activation="relu"),
                keras.layers.Dense(1),
            ])
            model.compile(keras.optimizers.SGD(0.01), "mse")
            return model

        x = np.random.rand(64, 4).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        tuner = kg.tuner.ParallelTuner(
            build, objective="loss", max_trials=2, parallel_trials=2, seed=0,
            directory="tuning", project_name="paths", overwrite=True,
        )
        tuner.search(x, y, epochs=1, verbose=0)
        for trial_id, path in tuner.trial_paths().items():
            print(trial_id, path["path"], path.get("group") or path.get("program"))
        # TensorFlow (executor="auto" packs):  0 fused fused group 0 with trial 1
        # JAX (executor="auto" fills slots):    0 slot 0
        ```
        """
        return {
            trial_id: dict(self._trial_paths[trial_id]) for trial_id in sorted(self._trial_paths)
        }

    def results_summary(self, num_trials: int = 10) -> None:
        """Prints KerasTuner's summary of the best trials, each with the path it took.

        Each trial's block is KerasTuner's (`Trial.summary()`: hyperparameters, score, the
        message of a failed trial), followed by a `Path:` line from `trial_paths()`:

        ```
        Path: alone: its model overrides `train_step`
        Path: graph (pack of trials 0, 1, 2): layer `twice` (Twice): layer type ...
        Path: fused (pack of trials 0, 1, 2; fused group 0 with trial 1): the planner ...
        Path: slot (program 0, slot 1): ...
        ```

        Args:
            num_trials: how many of the best trials to show. Defaults to `10`.
        """
        # KerasTuner's `BaseTuner.results_summary`, with a line after each trial's block,
        # printed as KerasTuner prints it (and `Trial.summary()` the trial's block).
        print("Results summary")  # noqa: T201
        print(f"Results in {self.project_dir}")  # noqa: T201
        print(f"Showing {num_trials} best trials")  # noqa: T201
        print(f"{self.oracle.objective}")  # noqa: T201
        for trial in self.oracle.get_best_trials(num_trials):
            print()  # noqa: T201
            trial.summary()
            if trial.trial_id in self._trial_paths:
                print(f"Path: {_path_line(self._trial_paths[trial.trial_id])}")  # noqa: T201

    def _record_path(self, trial_id: str, path: dict[str, str]) -> None:
        """Keeps `path` as trial `trial_id`'s (saved with the tuner's state) and logs it; a
        worker also sends it to its chief with the trial's end, naming itself."""
        if hasattr(self.oracle, "record_path"):  # a worker's `ChiefClient`
            path = {**path, "worker": self.tuner_id}
            self.oracle.record_path(trial_id, path)
        self._trial_paths[trial_id] = dict(path)
        logger.info("Trial %s: %s", trial_id, _path_line(path))

    def _record_ended(self, path: dict[str, str], reported: dict | None = None) -> None:
        """Records the paths workers `reported` with their trials' ends (by trial id), then
        `path` for the other ended trials without one (another process ran them), and
        saves."""
        for trial_id, own in (reported or {}).items():
            self._record_path(trial_id, own)
        ended = (TrialStatus.COMPLETED, TrialStatus.INVALID, TrialStatus.FAILED)
        for trial_id, trial in self.oracle.trials.items():
            if trial.status in ended and trial_id not in self._trial_paths:
                self._record_path(trial_id, path)
        self.save()

    # State -------------------------------------------------------------------------------

    def get_state(self) -> dict:
        """KerasTuner's tuner state, with each trial's path (`trial_paths`)."""
        return {**super().get_state(), "trial_paths": dict(self._trial_paths)}

    def set_state(self, state: dict) -> None:
        """Restores a state from `get_state` (one without paths, from an older version, too)."""
        super().set_state(state)
        self._trial_paths = dict(state.get("trial_paths", {}))

    def save(self) -> None:
        """Saves the oracle's and this tuner's state files atomically."""
        if os.environ.get(WORKER_ENV):
            return  # a local worker process has no state file: the project folder is KerasTuner's
        if not _upstream.is_worker(self):
            self.oracle.save()
        _state.write_json(_upstream.tuner_file(self), self.get_state())


def _overrides(cls: type, name: str) -> type | None:
    """The class below `ParallelTuner` in `cls`'s MRO that defines `name`, if any."""
    for klass in cls.__mro__:
        if klass is ParallelTuner:
            return None
        if name in vars(klass):
            return klass
    return None


def _path_line(path: dict[str, str]) -> str:
    """A trial's path (see `ParallelTuner.trial_paths`) as one line of text."""
    # A device's worker, named beside the path it took there (a "worker" path's own
    # reason names its worker).
    where = [f"worker {path['worker']}"] if path.get("worker") and path["path"] != "worker" else []
    where += [f"pack of {path['pack']}"] if "pack" in path else []
    where += [path["group"]] if "group" in path else []
    where += [f"program {path['program']}, slot {path['slot']}"] if "program" in path else []
    line = path["path"] + (f" ({'; '.join(where)})" if where else "") + f": {path['why']}"
    return line + (f"; earlier, {path['split']}" if "split" in path else "")


def _warn_idle() -> None:
    logger.warning(
        "The oracle answered IDLE with no trial running, so no trial end can change its "
        "answer; ending the search."
    )


def _resolved_executor(executor: str) -> str:
    """`executor`, with `"auto"` made the one that wins on this backend: on JAX the slots
    executor, on TensorFlow the pack executor (docs/benchmarks.md, "Parallel tuning against
    KerasTuner" and "Slots against packs")."""
    if executor != "auto":
        return executor
    return "slots" if keras.backend.backend() == "jax" else "pack"


def _checked_devices(devices: Any, executor: Any) -> str | tuple[str, ...] | None:
    """`devices` as `ParallelTuner` keeps it (GPU indices as `"0"`, `"1"`, ...), checked
    against the GPUs of this machine in the chief, or a clear error."""
    entries = [_devices.entry_of(d) for d in devices] if isinstance(devices, (list, tuple)) else []
    if devices is None or devices == "all":
        checked = devices
    elif entries and None not in entries and len(set(entries)) == len(entries):
        checked = tuple(e for e in entries if e is not None)
    else:
        raise ValueError(
            f'Invalid value for argument `devices`: got {devices!r}. Expected None, "all" '
            "(one worker per GPU of this machine) or a list of distinct GPU indices or UUIDs "
            '(e.g. [0, 1], or ["cpu0", "cpu1"] for CPU workers on a machine without GPUs).'
        )
    if checked is not None and executor == "processes":
        raise ValueError(
            'Invalid arguments: `devices` with executor="processes". With `devices`, each '
            "device's worker process trains `parallel_trials` trials at a time with the "
            'in-process executor ("auto", "pack" or "slots"); executor="processes" starts '
            "`parallel_trials` workers on one device instead. Pick one of the two."
        )
    if isinstance(checked, tuple) and not os.environ.get(WORKER_ENV):
        _devices.check_gpus(checked)
    return checked


def _check_arguments(parallel_trials: Any, executor: Any, fuse: Any, memory_limit_mb: Any) -> None:
    if (
        not isinstance(parallel_trials, int)
        or isinstance(parallel_trials, bool)
        or parallel_trials < 1
    ):
        raise ValueError(
            f"Invalid value for argument `parallel_trials`: got {parallel_trials!r}. Expected "
            "a positive integer: the number of trials to run at once (e.g. 4)."
        )
    if executor not in _EXECUTORS:
        raise ValueError(
            f'Invalid value for argument `executor`: got {executor!r}. Expected "auto", "pack" '
            '(trials trained together as ModelPacks), "slots" (trials streamed through the '
            'slots of packs kept for the search) or "processes" (one worker process per '
            "trial)."
        )
    if fuse not in ("auto", True, False):
        raise ValueError(
            f'Invalid value for argument `fuse`: got {fuse!r}. Expected "auto", True or False.'
        )
    if memory_limit_mb is not None and (
        not isinstance(memory_limit_mb, int) or memory_limit_mb < 1
    ):
        raise ValueError(
            f"Invalid value for argument `memory_limit_mb`: got {memory_limit_mb!r}. Expected "
            "a positive integer (MiB per worker), or None for memory growth."
        )
