"""`ParallelTuner`: KerasTuner trials K at a time on one GPU, as ModelPacks or processes."""

from __future__ import annotations

import logging
from typing import Any

import keras
import keras_tuner
from keras_tuner.src import utils as kt_utils
from keras_tuner.src.engine import hypermodel as hm_module
from keras_tuner.src.engine import trial as trial_module
from keras_tuner.src.engine.tuner import maybe_compute_model_size

from keras_gpushare.tuner import _state
from keras_gpushare.tuner.oracle import ParallelOracle

logger = logging.getLogger("keras_gpushare.tuner")

TrialStatus = trial_module.TrialStatus
_EXECUTORS = ("pack", "processes")


class ParallelTuner(keras_tuner.Tuner):
    """A KerasTuner `Tuner` that runs `parallel_trials` trials at once on one device.

    With `executor="pack"`, each round of up to K trials is built by the hypermodel and
    trained together as `ModelPack`s (one per batch size; same-architecture trials in their
    own pack so they can be fused). Each trial still reports its own per-epoch metrics to
    the oracle, writes its own checkpoint in its trial folder, is stopped early alone
    (a callback that stops "its" model stops only that member) and fails alone (a trial
    that raises while building, or whose loss stops being finite, is marked failed while
    the rest of its pack completes).

    With `executor="processes"`, K worker processes share the device (each calls
    `kg.share_gpu`) and take trials from a chief in this process over KerasTuner's own
    gRPC protocol on 127.0.0.1; a worker that dies is restarted and its trial run again.
    Workers on other machines can join the same chief (see `docs/tuner.md`).

    Everything else is KerasTuner's: the oracles, `search`, `results_summary`,
    `get_best_models`, `get_best_hyperparameters` and the project folder. A search that is
    killed at any moment and started again with `overwrite=False` finishes with exactly
    `max_trials` trials, none lost and none run twice.

    Args:
        hypermodel: a `keras_tuner.HyperModel` or a function `build(hp)` returning a
            compiled `keras.Model`. A hyperparameter named `"batch_size"` sets a trial's
            batch size. Defaults to `None`.
        oracle: a `keras_tuner.Oracle` (RandomSearch, BayesianOptimization, Hyperband,
            GridSearch, ...); `None` makes a `RandomSearchOracle` from `objective`,
            `max_trials` and `seed`. Defaults to `None`.
        objective: the objective for the default oracle, e.g. `"val_loss"`. Defaults to
            `None`.
        max_trials: trials in all, for the default oracle. Defaults to `None` (10).
        parallel_trials: trials running at once (pack size or worker count). Defaults to
            `4`.
        executor: `"pack"` or `"processes"`. Defaults to `"pack"`.
        fuse: passed to `ModelPack` (`"auto"`, `True`, `False`). Defaults to `"auto"`.
        seed: seed of the default oracle. Defaults to `None`.
        memory_limit_mb: with `executor="processes"` on a GPU, each worker's memory cap in
            MiB (`kg.share_gpu(memory_limit_mb=...)`); `None` turns on memory growth
            instead. Defaults to `None`.
        directory: the folder holding projects. Defaults to `None` (the current folder).
        project_name: the project's folder name. Defaults to `None` ("untitled_project").
        overwrite: start afresh instead of resuming the project. Defaults to `False`.
        **kwargs: other `keras_tuner.Tuner` arguments (`max_model_size`, `optimizer`,
            `loss`, `metrics`, `executions_per_trial` with `executor="processes"`).

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
    tuner.search(x, y, epochs=2, validation_split=0.25, verbose=0)
    best_hp = tuner.get_best_hyperparameters()[0]
    ```
    """

    def __init__(
        self,
        hypermodel: Any = None,
        oracle: keras_tuner.Oracle | None = None,
        objective: Any = None,
        max_trials: int | None = None,
        parallel_trials: int = 4,
        executor: str = "pack",
        fuse: str | bool = "auto",
        seed: int | None = None,
        memory_limit_mb: int | None = None,
        directory: str | None = None,
        project_name: str | None = None,
        overwrite: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_arguments(parallel_trials, executor, fuse, memory_limit_mb)
        if executor == "pack":
            _check_pack_arguments(hypermodel, kwargs)
        if oracle is None:
            oracle = keras_tuner.oracles.RandomSearchOracle(
                objective=objective, max_trials=10 if max_trials is None else max_trials, seed=seed
            )
        elif objective is not None or max_trials is not None or seed is not None:
            raise ValueError(
                "Invalid arguments: got an `oracle` together with `objective`, `max_trials` "
                "or `seed`. These set up the default oracle only; pass them to your oracle "
                "instead, e.g. `RandomSearchOracle(objective='val_loss', max_trials=20, seed=1)`."
            )
        self.parallel_trials = parallel_trials
        self.executor = executor
        self.fuse = fuse
        self.memory_limit_mb = memory_limit_mb
        self._tuner_kwargs = dict(kwargs)
        cap = parallel_trials if executor == "pack" else None
        super().__init__(
            oracle=ParallelOracle(oracle, parallel_trials=cap),
            hypermodel=hypermodel,
            directory=directory,
            project_name=project_name,
            overwrite=overwrite,
            **kwargs,
        )

    # Search ------------------------------------------------------------------------------

    def search(self, *fit_args: Any, **fit_kwargs: Any) -> None:
        """Runs the search; takes the arguments of `model.fit` (data, epochs, callbacks...).

        Args:
            *fit_args: positional arguments of `fit`, e.g. `x, y`.
            **fit_kwargs: keyword arguments of `fit`, e.g. `epochs=10,
                validation_data=(x_val, y_val), callbacks=[...]`. Callbacks must be
                deep-copyable (each trial gets its own copy).
        """
        if self._is_worker():
            from keras_gpushare.tuner import workers

            workers.run_worker(self, fit_args, fit_kwargs)
            return
        if "verbose" in fit_kwargs:
            self.oracle.verbose = fit_kwargs["verbose"]
        # Write the project state before any trial exists, so that a run killed from
        # here on is always resumed (KerasTuner reloads only when the tuner file exists).
        self.save()
        if self.executor == "processes":
            from keras_gpushare.tuner import workers

            workers.run_chief(self, fit_args, fit_kwargs)
            return
        self._search_packs(fit_args, fit_kwargs)

    def _search_packs(self, fit_args: tuple, fit_kwargs: dict) -> None:
        from keras_gpushare.tuner import _pack_executor

        slots = [f"{self.tuner_id}-{i}" for i in range(self.parallel_trials)]
        self.on_search_begin()
        while True:
            trials, stopped = self._next_round(slots)
            if not trials:
                break
            for trial in trials:
                self.on_trial_begin(trial)
            _pack_executor.run_trials(self, trials, fit_args, fit_kwargs)
            error = None
            for trial in trials:
                try:
                    self.on_trial_end(trial)
                except RuntimeError as e:
                    error = error or e
            if error is not None:
                raise error
            if stopped:
                break
        self.on_search_end()

    def _next_round(self, slots: list[str]) -> tuple[list[trial_module.Trial], bool]:
        trials = []
        for slot in slots:
            self.pre_create_trial()
            trial = self.oracle.create_trial(slot)
            if trial.status == TrialStatus.STOPPED:
                return trials, True
            if trial.status == TrialStatus.IDLE:
                if not trials and not self.oracle.ongoing_trials:
                    logger.warning(
                        "The oracle answered IDLE with no trial running, so no trial end can "
                        "change its answer; ending the search."
                    )
                    return trials, True
                break
            trials.append(trial)
        return trials, False

    # Building ----------------------------------------------------------------------------

    def _build_trial_model(self, hp: Any) -> keras.Model:
        """`Tuner._try_build` without `clear_session` (the round's other models live on)."""
        model = self._build_hypermodel(hp)
        if not isinstance(model, keras.Model):
            raise keras_tuner.errors.FatalTypeError(
                "Expected the model-building function, or HyperModel.build() to return a "
                f"keras.Model. Received: {model!r} of type {type(model).__name__}."
            )
        size = maybe_compute_model_size(model)
        if self.max_model_size and size > self.max_model_size:
            raise keras_tuner.errors.FailedTrialError(
                f"Oversized model: {size} parameters. Skip model."
            )
        return model

    def _build_hypermodel(self, hp: Any) -> keras.Model:
        model = super()._build_hypermodel(hp)
        # Hyperband: a trial promoted to the next round starts from its parent's weights.
        parent = hp.values.get("tuner/trial_id")
        if parent is not None:
            if not model.built:
                model.build_from_config(kt_utils.load_json(self._get_build_config_fname(parent)))
            model.load_weights(self._get_checkpoint_fname(parent))
        return model

    def run_trial(self, trial: trial_module.Trial, *fit_args: Any, **fit_kwargs: Any) -> Any:
        """Runs one trial alone (the processes executor's workers), honouring Hyperband."""
        values = trial.hyperparameters.values
        if "tuner/epochs" in values:
            fit_kwargs["epochs"] = values["tuner/epochs"]
            fit_kwargs["initial_epoch"] = values["tuner/initial_epoch"]
        if "batch_size" in values:
            fit_kwargs["batch_size"] = values["batch_size"]
        return super().run_trial(trial, *fit_args, **fit_kwargs)

    def _save_build_config(self, trial_id: str, model: keras.Model) -> None:
        _state.write_json(self._get_build_config_fname(trial_id), model.get_build_config())

    # State -------------------------------------------------------------------------------

    def save(self) -> None:
        """Saves the oracle's and this tuner's state files atomically."""
        if not self._is_worker():
            self.oracle.save()
        _state.write_json(self._get_tuner_fname(), self.get_state())


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
            f'Invalid value for argument `executor`: got {executor!r}. Expected "pack" '
            '(trials trained together as ModelPacks) or "processes" (one worker process '
            "per trial)."
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


def _check_pack_arguments(hypermodel: Any, kwargs: dict) -> None:
    if kwargs.get("executions_per_trial", 1) != 1:
        raise ValueError(
            "Invalid value for argument `executions_per_trial`: got "
            f'{kwargs["executions_per_trial"]!r} with executor="pack", which runs each trial '
            'once. Use executor="processes" for several executions per trial.'
        )
    if kwargs.get("distribution_strategy") is not None:
        raise ValueError(
            'Invalid argument `distribution_strategy` with executor="pack": a pack trains '
            'its trials on one device. Remove it, or use executor="processes".'
        )
    if hypermodel is None:
        return
    hm = hm_module.get_hypermodel(hypermodel)
    if type(hm).fit is not keras_tuner.HyperModel.fit:
        raise ValueError(
            f"Invalid value for argument `hypermodel`: {type(hm).__name__} overrides "
            '`HyperModel.fit`, which executor="pack" cannot call (its trials train together '
            'in one `fit`). Tune the batch size with a hyperparameter named "batch_size" '
            'instead, or use executor="processes", which calls your `fit` for each trial.'
        )
