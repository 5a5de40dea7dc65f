"""The "pack" executor: one round of trials built by the hypermodel, trained as ModelPacks."""

from __future__ import annotations

import gc
import logging
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack import ModelPack
from keras_gpushare.pack.program import open_program
from keras_gpushare.tuner._data_orders import (
    DealOrders,
    OrderCheck,
    dealt_arguments,
    trial_order,
)
from keras_gpushare.tuner._executor import (
    RoundExecutor,
    TrialCalls,
    TrialFeed,
    TrialOutcome,
    error_line,
)
from keras_gpushare.tuner._search_ledger import EpochCounter
from keras_gpushare.tuner._trial_callbacks import (
    BestCheckpoint,
    PackTrials,
    PackTrialsWithBatches,
    TrialRun,
    implements_batch_hooks,
)

logger = logging.getLogger("keras_gpushare.tuner")

if TYPE_CHECKING:
    from keras_tuner.engine.trial import Trial

trial_module = _upstream.kt_trial_module()


class PackExecutor(RoundExecutor):
    """The "pack" executor: each round of trials trains together as `ModelPack`s.

    Args:
        calls: what training a trial needs from the tuner.
    """

    def __init__(self, calls: TrialCalls) -> None:
        self.calls = calls
        self._orders = OrderCheck((), {"shuffle": False})

    def run(self, feed: TrialFeed, fit_args: tuple, fit_kwargs: dict) -> None:
        self._orders = OrderCheck(fit_args, fit_kwargs)
        super().run(feed, fit_args, fit_kwargs)

    def run_round(self, trials: list, fit_args: tuple, fit_kwargs: dict) -> dict:
        """Trains `trials` (each with its `executions_per_trial` executions) together.

        A trial whose model trains itself (it overrides `fit`, `train_step`, `test_step` or
        `compute_loss`), or whose pack of executions raises, runs after the packs with
        KerasTuner's own `run_trial`, exactly as KerasTuner would run it.

        Returns:
            `{trial_id: TrialOutcome}`: per trial, one `History` per execution (as
            KerasTuner's `Tuner.run_trial` returns them), or the exception that building or
            training it raised, with the path it took (`TrialOutcome.path`). Nothing is
            reported to the oracle here.
        """
        calls = self.calls
        keras.backend.clear_session()
        gc.collect()
        outcomes: dict[str, TrialOutcome] = {}
        alone: dict[str, tuple] = {}
        paths: dict[str, dict[str, str]] = {}
        runs: list[TrialRun] = []
        for trial in trials:
            try:
                trial_runs = _prepare(calls, trial, fit_kwargs)
            except Exception as e:
                outcomes[trial.trial_id] = TrialOutcome(error=e, path=_not_trained(e))
                continue
            own = _own_training(trial_runs[0].model)
            if own:
                alone[trial.trial_id] = (
                    trial,
                    {"path": "alone", "why": f"its model overrides {own}"},
                )
            else:
                runs.extend(trial_runs)
        for group in _groups(runs, fit_kwargs):
            dealt = self._orders.deals(group)
            _fit_group(calls, group, fit_args, fit_kwargs, outcomes, alone, paths, dealt=dealt)
        by_trial: dict[str, list[TrialRun]] = defaultdict(list)
        for run in runs:
            by_trial[run.trial.trial_id].append(run)
        for trial_id, trial_runs in by_trial.items():
            if trial_id not in outcomes and trial_id not in alone:
                outcomes[trial_id] = TrialOutcome(
                    results=[run.results() for run in trial_runs], path=paths[trial_id]
                )
        # KerasTuner's run_trial clears the Keras session: only once every pack has trained.
        for trial_id, (trial, path) in alone.items():
            outcomes[trial_id] = _run_alone(calls, trial, path, fit_args, fit_kwargs)
        return outcomes


def _own_training(model: keras.Model) -> str:
    """The training methods `model`'s class overrides, which a pack would not call."""
    names = ("fit", "train_step", "test_step", "compute_loss")
    own = [f"`{n}`" for n in names if getattr(type(model), n) is not getattr(keras.Model, n)]
    return ", ".join(own)


def _run_alone(
    calls: TrialCalls, trial: Any, path: dict[str, str], fit_args: tuple, fit_kwargs: dict
) -> TrialOutcome:
    logger.warning(
        "Trial %s runs alone with KerasTuner's run_trial, as KerasTuner runs it: %s.",
        trial.trial_id,
        path["why"],
    )
    calls.ledger.alone += 1
    try:
        results = calls.run_alone(trial, *fit_args, **dict(fit_kwargs))
    except Exception as e:
        return TrialOutcome(error=e, path=path)
    return TrialOutcome(results=results, path=path)


def _not_trained(error: BaseException) -> dict[str, str]:
    """The path of a trial whose model could not be built."""
    return {"path": "not trained", "why": f"building its model raised {error_line(error)}"}


def _pack_label(runs: list[TrialRun], fit_kwargs: dict) -> str:
    """The pack's trials, e.g. `"trials 3, 4, 7 (batch size 64)"`."""
    trial_ids = list(dict.fromkeys(run.trial.trial_id for run in runs))
    label = f"trial{'s' if len(trial_ids) > 1 else ''} {', '.join(trial_ids)}"
    details = []
    if len(runs) > len(trial_ids):
        details.append(f"{len(runs)} models")
    batch_size = _batch_size(runs[0], fit_kwargs)
    if batch_size is not None:
        details.append(f"batch size {batch_size}")
    start = _start_epoch(runs[0], fit_kwargs)
    if start:
        details.append(f"from epoch {start}")
    return f"{label} ({', '.join(details)})" if details else label


def _in_trials(text: str, runs: list[TrialRun]) -> str:
    """`text` (the planner's, or a pack's error) with the pack's member numbers as the
    trials they belong to."""

    def name(i: int) -> str:
        run = runs[i]
        if any(r.execution for r in runs):
            return f"trial {run.trial.trial_id} (execution {run.execution})"
        return f"trial {run.trial.trial_id}"

    def names(match: re.Match) -> str:
        return ", ".join(name(int(i)) for i in match.group(1).split(", "))

    return re.sub(r"\b[Mm]embers? (\d+(?:, \d+)*)", names, text)


def _pack_path(pack: ModelPack, runs: list[TrialRun], trial_id: str, label: str) -> dict[str, str]:
    """Where the pack's planner put trial `trial_id`'s models, and why (`label`: the pack's,
    from `_pack_label`).

    A trial whose models are all in fused groups took the path `"fused"`, one whose models
    are all on the graph engine `"graph"` (with the planner's reason), and `"mixed"` else.
    """
    plan = pack.engine_plan
    mine = {i for i, run in enumerate(runs) if run.trial.trial_id == trial_id}
    path = {"path": "graph", "pack": label}
    groups, whys = [], []
    for k, (group, waste) in enumerate(zip(plan.groups, plan.waste)):
        if not mine & set(group):
            continue
        others = sorted({runs[i].trial.trial_id for i in group if i not in mine})
        if others:
            groups.append(
                f"fused group {k} with trial{'s' if len(others) > 1 else ''} {', '.join(others)}"
            )
            padding = f"{waste:.0%} of the group's FLOPs are padding" if waste else "no padding"
            whys.append(f"the planner stacks its model with theirs into one model ({padding})")
        else:
            groups.append(f"fused group {k} with no other trial")
            whys.append("the planner put it in a fused group of its own")
    graph = [i for i in plan.graph if i in mine]
    whys.extend(_in_trials(plan.reasons[i], runs).rstrip(".") for i in graph)
    if groups:
        path["path"] = "mixed" if graph else "fused"
        path["group"] = "; ".join(groups)
    path["why"] = "; ".join(dict.fromkeys(whys))
    return path


def _prepare(calls: TrialCalls, trial: Trial, fit_kwargs: dict) -> list[TrialRun]:
    """Builds the trial's models (one per execution) and their callbacks, as KerasTuner."""
    checkpoint = BestCheckpoint(calls.objective, calls.checkpoint_file(trial.trial_id))
    values = trial.hyperparameters.values
    last_epoch = values.get("tuner/epochs", fit_kwargs.get("epochs", 1))
    runs = []
    for execution in range(calls.executions_per_trial):
        callbacks = calls.copy_callbacks(list(fit_kwargs.get("callbacks") or []))
        calls.configure_tensorboard(callbacks, trial, execution)
        model = calls.build_model(trial.hyperparameters)
        state = calls.build_state(model)
        runs.append(
            TrialRun(calls, trial, execution, model, callbacks, last_epoch, checkpoint, state)
        )
    calls.ledger.trial(trial.trial_id, runs[0].model)
    return runs


def _batch_size(run: TrialRun, fit_kwargs: dict) -> Any:
    return run.trial.hyperparameters.values.get("batch_size", fit_kwargs.get("batch_size"))


def _start_epoch(run: TrialRun, fit_kwargs: dict) -> int:
    """The epoch the trial's `fit` starts from: Hyperband's, else the search's."""
    values = run.trial.hyperparameters.values
    return values.get("tuner/initial_epoch", fit_kwargs.get("initial_epoch", 0))


def _groups(runs: list[TrialRun], fit_kwargs: dict) -> list[list[TrialRun]]:
    """Packs: one per batch size and start epoch, split by last epoch where that pays.

    Within a pack, `ModelPack`'s planner (`fuse="auto"`) fuses trials of one skeleton into
    groups (padding widths and depths, per-member activations and optimizer families) and
    trains what does not fuse on the graph engine, all in one step. See `_by_length` for
    trials of different lengths.
    """
    by_key: dict[tuple, list[TrialRun]] = defaultdict(list)
    for run in runs:
        by_key[(repr(_batch_size(run, fit_kwargs)), _start_epoch(run, fit_kwargs))].append(run)
    return [pack for same_start in by_key.values() for pack in _by_length(same_start, fit_kwargs)]


def _by_length(runs: list[TrialRun], fit_kwargs: dict) -> list[list[TrialRun]]:
    """`runs` (one start epoch) as one pack, or one pack per last epoch when one pack would
    spend over half its member-epochs on trials that have ended.

    A pack trains until its longest trial's last epoch and computes every member at each
    step, a member whose trial has ended too (its weights kept as they are). Hyperband's first
    round mixes trials of 1, 3 and 9 epochs: one pack of 16 spends 144 member-epochs where 42
    are needed. On this 2-core CPU, KerasTuner's getting-started space under Hyperband
    (`max_epochs=9`, K=16) took 22.7 s with a pack per length against 34.1 s in one pack per
    start epoch (`benchmarks/tuner.py --oracle hyperband`). Trials of close lengths stay
    together: each extra pack pays its own building and tracing.
    """
    start = _start_epoch(runs[0], fit_kwargs)
    longest = max(run.last_epoch for run in runs)
    needed = sum(max(run.last_epoch - start, 0) for run in runs)
    if len(runs) * (longest - start) <= 2 * needed:
        return [runs]
    by_length: dict[int, list[TrialRun]] = defaultdict(list)
    for run in runs:
        by_length[run.last_epoch].append(run)
    return list(by_length.values())


def _compile_args(models: list[keras.Model], batch_hooks: bool) -> dict:
    """`compile` arguments of a pack of `models` (trials' models, or probe builds)."""
    configs = []
    for model in models:
        if not model.compiled:
            raise ValueError(
                f"The hypermodel returned an uncompiled model (`{model.name}`). Compile it in "
                "the build function, or pass `optimizer=` and `loss=` to ParallelTuner."
            )
        # The objects the trial's model was compiled with (a loss function or metric class
        # needs no registration, as in KerasTuner), with an optimizer of its own for the pack.
        config = _upstream.compile_arguments(model)
        config["optimizer"] = keras.optimizers.deserialize(
            keras.optimizers.serialize(model.optimizer)
        )
        configs.append(config)
    single = len(models) == 1

    def per_member(key: str) -> Any:
        values = [config.get(key) for config in configs]
        return values[0] if single else values

    loss_weights = {repr(config.get("loss_weights")) for config in configs}
    if len(loss_weights) > 1:
        raise ValueError("Trials with different `loss_weights` cannot train in one pack.")
    # Compile the pack with XLA when the trials' own models would have been (Keras resolves
    # `jit_compile="auto"` per model: on with a GPU, off on CPUs, where XLA's compile time
    # outweighs its gain for trials of a few epochs).
    jit = {bool(model.jit_compile) for model in models}
    args = {
        "jit_compile": jit.pop() if len(jit) == 1 else "auto",
        "optimizer": per_member("optimizer"),
        "loss": per_member("loss"),
        "metrics": per_member("metrics"),
        "weighted_metrics": per_member("weighted_metrics"),
        "loss_weights": configs[0].get("loss_weights"),
    }
    if batch_hooks:
        # Callbacks with batch hooks see each batch, as they would with the trials' own
        # `steps_per_execution` (1 unless the build function set it).
        args["steps_per_execution"] = min(c.get("steps_per_execution") or 1 for c in configs)
    return args


def _fit_group(
    calls: TrialCalls,
    runs: list[TrialRun],
    fit_args: tuple,
    fit_kwargs: dict,
    outcomes: dict,
    alone: dict,
    paths: dict,
    split: str | None = None,
    dealt: bool = False,
) -> None:
    """Trains `runs` as one pack, or, when it raises, each of its trials in a pack alone.

    Fills `paths` with each trained trial's path (noting `split`, the failed pack that
    made it train alone), `outcomes` with the trials that could not be rebuilt, and
    `alone` with those to run with KerasTuner's `run_trial`. With `dealt`, each member
    trains on its own trial's data order (`_data_orders.DealtBatches`).
    """
    trial_ids = list(dict.fromkeys(run.trial.trial_id for run in runs))
    try:
        batch_size = _batch_size(runs[0], fit_kwargs)
        feed: tuple = fit_args
        kwargs = dict(fit_kwargs)
        callbacks = [cb for run in runs for cb in run.callbacks]
        own_orders: list = []
        if dealt:
            dealt_fit = dealt_arguments(fit_args, fit_kwargs, batch_size, len(runs))
            dataset, kwargs = dealt_fit
            start = _start_epoch(runs[0], fit_kwargs)
            pairs = [(trial_order(run, dealt_fit, fit_kwargs, start), run) for run in runs]
            feed, batch_size = (dataset,), None
            own_orders = [DealOrders(dataset, lambda: [o if r.active else None for o, r in pairs])]
        models = [run.model for run in runs]
        pack = open_program(models, calls.fuse, settings_as_data=False, dealt=dealt)
        batch_hooks = calls.batch_hooks or implements_batch_hooks(callbacks)
        pack.compile(**_compile_args([run.model for run in runs], batch_hooks))
        calls.ledger.compiled(pack, [run.model for run in runs], slot_values=False)
        kwargs["epochs"] = max(run.last_epoch for run in runs)
        hooks = PackTrialsWithBatches if batch_hooks else PackTrials
        # Checkpoints hold weights alone: the trials' optimizer state is refreshed at each
        # epoch end only for the user's callbacks and tuner hooks.
        optimizer_state = bool(callbacks) or calls.epoch_end_hook
        kwargs["callbacks"] = [
            *own_orders,
            hooks(pack, runs, kwargs["epochs"], optimizer_state),
            EpochCounter(
                calls.ledger, pack, lambda: [run.trial.trial_id for run in runs if run.active]
            ),
        ]
        kwargs["initial_epoch"] = _start_epoch(runs[0], fit_kwargs)
        if batch_size is not None:
            kwargs["batch_size"] = batch_size
        logger.info(
            "Training trials %s as one pack of %d models (%s engine)%s.",
            ", ".join(trial_ids),
            len(runs),
            pack.engine,
            ", each on its own trial's data order" if dealt else "",
        )
        pack.fit(*feed, **kwargs)
        for run in runs:
            if run.execution == 0:
                calls.save_build_config(run.trial.trial_id, run.model)
    except Exception as e:
        for run in runs:
            run.abandon()
        raised = _in_trials(error_line(e), runs)
        if len(trial_ids) == 1:
            # Whatever a pack cannot do, KerasTuner's own code does (or raises its error).
            path = {"path": "alone", "why": f"its pack raised {raised}"}
            alone[trial_ids[0]] = (runs[0].trial, _with_split(path, split))
            return
        logger.warning(
            "A pack of %d trials raised %s: %s; training each trial alone to find which.",
            len(trial_ids),
            type(e).__name__,
            e,
        )
        split = (
            f"the pack of {_pack_label(runs, fit_kwargs)} raised {raised}; each of "
            "its trials was then packed alone to find which"
        )
        for trial in dict.fromkeys(run.trial for run in runs):
            try:
                again = _prepare(calls, trial, fit_kwargs)
            except Exception as error:
                path = _with_split(_not_trained(error), split)
                outcomes[trial.trial_id] = TrialOutcome(error=error, path=path)
                continue
            _fit_group(calls, again, fit_args, fit_kwargs, outcomes, alone, paths, split)
            if trial.trial_id not in outcomes and trial.trial_id not in alone:
                outcomes[trial.trial_id] = TrialOutcome(
                    results=[r.results() for r in again], path=paths[trial.trial_id]
                )
    else:
        label = _pack_label(runs, fit_kwargs)
        for trial_id in trial_ids:
            paths[trial_id] = _with_split(_pack_path(pack, runs, trial_id, label), split)


def _with_split(path: dict[str, str], split: str | None) -> dict[str, str]:
    """`path`, noting the failed pack `split` that made its trial train alone, if any."""
    return path if split is None else {**path, "split": split}
