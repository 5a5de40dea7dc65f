"""The "pack" executor: one round of trials built by the hypermodel, trained as ModelPacks."""

from __future__ import annotations

import gc
import logging
import traceback
from collections import defaultdict
from typing import Any

import keras
from keras_tuner.src import errors
from keras_tuner.src.engine import trial as trial_module
from keras_tuner.src.engine import tuner_utils

from keras_gpushare.pack import ModelPack
from keras_gpushare.pack.fusion.converter import fusion_signature
from keras_gpushare.tuner._trial_callbacks import PackTrials, TrialRun

logger = logging.getLogger("keras_gpushare.tuner")

TrialStatus = trial_module.TrialStatus


def run_trials(tuner: Any, trials: list, fit_args: tuple, fit_kwargs: dict) -> None:
    """Trains `trials` together and reports each one's metrics to the oracle.

    Sets every trial's `status` (COMPLETED, INVALID or FAILED) and `message`; ending the
    trials is left to the caller. A `keras_tuner.errors.FatalError` aborts the round.
    """
    keras.backend.clear_session()
    gc.collect()
    runs = []
    for trial in trials:
        run = _prepare(tuner, trial, fit_kwargs)
        if run is not None:
            runs.append(run)
    for group in _groups(runs, tuner.fuse, fit_kwargs):
        _fit_group(tuner, group, fit_args, fit_kwargs)


def _fail(trial: trial_module.Trial, error: BaseException) -> None:
    """Marks `trial` as KerasTuner does: FAILED for `FailedTrialError`, else INVALID."""
    if isinstance(error, errors.FatalError):
        raise error
    failed = isinstance(error, errors.FailedTrialError)
    trial.status = TrialStatus.FAILED if failed else TrialStatus.INVALID
    trial.message = "".join(traceback.format_exception(error))
    logger.warning("Trial %s: %s: %s", trial.trial_id, type(error).__name__, error)


def _prepare(tuner: Any, trial: trial_module.Trial, fit_kwargs: dict) -> TrialRun | None:
    """Builds the trial's model and its callbacks; marks the trial failed when that raises."""
    try:
        model = tuner._build_trial_model(trial.hyperparameters)
        callbacks = tuner._deepcopy_callbacks(list(fit_kwargs.get("callbacks") or []))
        tuner._configure_tensorboard_dir(callbacks, trial)
    except Exception as e:
        _fail(trial, e)
        return None
    values = trial.hyperparameters.values
    last_epoch = values.get("tuner/epochs", fit_kwargs.get("epochs", 1))
    return TrialRun(tuner, trial, model, callbacks, last_epoch)


def _batch_size(run: TrialRun, fit_kwargs: dict) -> Any:
    return run.trial.hyperparameters.values.get("batch_size", fit_kwargs.get("batch_size"))


def _groups(runs: list[TrialRun], fuse: Any, fit_kwargs: dict) -> list[list[TrialRun]]:
    """Packs: by batch size and start epoch; with fusion, large same-architecture groups.

    Each `fit` costs a fixed tracing and compiling time, which dominates short trials, so
    trials that can fuse (equal `fusion_signature`: dropout rates, weights and optimizer
    settings may differ) get a pack of their own, which can be fused, only when they are at
    least half of their group; all other trials train together in one pack.
    """
    by_key: dict[tuple, list[TrialRun]] = defaultdict(list)
    for run in runs:
        values = run.trial.hyperparameters.values
        key = (repr(_batch_size(run, fit_kwargs)), values.get("tuner/initial_epoch", 0))
        by_key[key].append(run)
    groups = []
    for members in by_key.values():
        if fuse is False:
            groups.append(members)
            continue
        by_arch: dict[tuple, list[TrialRun]] = defaultdict(list)
        for run in members:
            by_arch[fusion_signature(run.model) or id(run)].append(run)
        mixed = []
        for same in by_arch.values():
            if len(same) > 1 and 2 * len(same) >= len(members):
                groups.append(same)
            else:
                mixed.extend(same)
        if mixed:
            groups.append(mixed)
    return groups


def _compile_args(runs: list[TrialRun]) -> dict:
    configs = []
    for run in runs:
        if not run.model.compiled:
            raise ValueError(
                f"The hypermodel returned an uncompiled model for trial {run.trial.trial_id}. "
                "Compile it in the build function, or pass `optimizer=` and `loss=` to "
                "ParallelTuner."
            )
        configs.append(keras.saving.deserialize_keras_object(run.model.get_compile_config()))
    single = len(runs) == 1

    def per_member(key: str) -> Any:
        values = [config.get(key) for config in configs]
        return values[0] if single else values

    loss_weights = {repr(config.get("loss_weights")) for config in configs}
    if len(loss_weights) > 1:
        raise ValueError("Trials with different `loss_weights` cannot train in one pack.")
    # Compile the pack with XLA when the trials' own models would have been (Keras resolves
    # `jit_compile="auto"` per model: on with a GPU, off on CPUs, where XLA's compile time
    # outweighs its gain for trials of a few epochs).
    jit = {bool(run.model.jit_compile) for run in runs}
    return {
        "jit_compile": jit.pop() if len(jit) == 1 else "auto",
        "optimizer": per_member("optimizer"),
        "loss": per_member("loss"),
        "metrics": per_member("metrics"),
        "weighted_metrics": per_member("weighted_metrics"),
        "loss_weights": configs[0].get("loss_weights"),
    }


def _fit_group(tuner: Any, runs: list[TrialRun], fit_args: tuple, fit_kwargs: dict) -> None:
    try:
        pack = ModelPack([run.model for run in runs], fuse=tuner.fuse)
        pack.compile(**_compile_args(runs))
        kwargs = dict(fit_kwargs)
        kwargs["epochs"] = max(run.last_epoch for run in runs)
        kwargs["callbacks"] = [PackTrials(pack, runs, kwargs["epochs"])]
        values = runs[0].trial.hyperparameters.values
        kwargs["initial_epoch"] = values.get("tuner/initial_epoch", kwargs.get("initial_epoch", 0))
        batch_size = _batch_size(runs[0], fit_kwargs)
        if batch_size is not None:
            kwargs["batch_size"] = batch_size
        logger.info(
            "Training trials %s as one pack (%s engine).",
            ", ".join(run.trial.trial_id for run in runs),
            pack.engine,
        )
        pack.fit(*fit_args, **kwargs)
    except errors.FatalError:
        raise
    except Exception as e:
        if len(runs) == 1:
            runs[0].clear_checkpoint()
            _fail(runs[0].trial, e)
            return
        logger.warning(
            "A pack of %d trials raised %s: %s; training each trial alone to find which.",
            len(runs),
            type(e).__name__,
            e,
        )
        for run in runs:
            run.clear_checkpoint()
            alone = _prepare(tuner, run.trial, fit_kwargs)
            if alone is not None:
                _fit_group(tuner, [alone], fit_args, fit_kwargs)
        return
    for run in runs:
        _report(tuner, run)


def _report(tuner: Any, run: TrialRun) -> None:
    trial = run.trial
    if run.diverged_epoch is not None:
        trial.status = TrialStatus.FAILED
        trial.message = (
            f"Diverged: the loss or gradients stopped being finite in epoch "
            f"{run.diverged_epoch + 1}; the ModelPack froze this member."
        )
        logger.warning("Trial %s: %s", trial.trial_id, trial.message)
    try:
        results = run.results()
        tuner_utils.validate_trial_results(results, tuner.oracle.objective, "ModelPack.fit()")
        for epoch, logs in _epoch_logs(run):
            tuner.oracle.update_trial(trial.trial_id, logs, step=epoch)
        if not run.epochs:
            raise errors.FailedTrialError("The trial trained for no epoch.")
        tuner._save_build_config(trial.trial_id, run.model)
    except Exception as e:
        _fail(trial, e)
        return
    if trial.status not in (TrialStatus.FAILED, TrialStatus.INVALID):
        trial.status = TrialStatus.COMPLETED


def _epoch_logs(run: TrialRun) -> list[tuple[int, dict]]:
    return [
        (epoch, {key: values[i] for key, values in run.history.items()})
        for i, epoch in enumerate(run.epochs)
    ]
