"""The parts of a program (`_program_executor`): a compiled pack with slots, its epoch
callback, and the trial helpers both kinds of program share.

A program (`Program`) is a `ModelPack` opened by `keras_gpushare.pack.program` with one slot
per trial execution; `ProgramEpoch` is the one callback every program's `fit` runs: each
slot's trial sees its own epoch number, figures, callbacks and tuner hooks, and at each
epoch's end the trials whose last epoch it was end and free their slots.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack import ModelPack
from keras_gpushare.tuner._data_orders import DealtBatches, TrialOrder
from keras_gpushare.tuner._executor import TrialCalls, TrialOutcome, error_line
from keras_gpushare.tuner._trial_callbacks import BestCheckpoint, TrialRun

logger = logging.getLogger("keras_gpushare.tuner")

if TYPE_CHECKING:
    from keras_tuner.engine.trial import Trial


class Program:
    """One compiled pack, the trial execution in each of its slots (`None`: free), and the
    trials it was opened for.

    Args:
        number: the program's number in the search (for the trials' paths and the logs).
        pack: the compiled `ModelPack` (`keras_gpushare.pack.program.open_program`).
        runs: each slot's first occupant (`None`: free until a trial loads into it).
        batch_key: the trials' batch size, as `repr` (a program trains one).
        batch_hooks: whether its `fit` forwards train-batch events to the trials.
        refills: whether a freed slot takes the next trial ("slots") or stays free until
            the program's trials have all ended ("pack").
        dealt: where each slot trains on its own trial's data order: the program's batches
            and its `fit` arguments (`_data_orders.dealt_arguments`).
        planned: why it was opened, where it was planned from the space.
    """

    def __init__(
        self,
        number: int,
        pack: ModelPack,
        runs: list[TrialRun | None],
        batch_key: str,
        batch_hooks: bool,
        refills: bool,
        dealt: tuple[DealtBatches, dict] | None = None,
        planned: str | None = None,
    ) -> None:
        self.number = number
        self.pack = pack
        self.batch_key = batch_key
        self.slots: list[TrialRun | None] = list(runs)
        self.batch_hooks = batch_hooks
        self.refills = refills
        # Why it was opened: for trials `opened_for`, or `planned` from the search space.
        self.opened_for = ", ".join(dict.fromkeys(run.trial.trial_id for run in runs if run))
        self.planned = planned
        self.dealt = dealt
        # Each slot's `TrialOrder` where the program deals.
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


class ProgramEpoch(keras.callbacks.Callback):
    """Every program's epochs: each slot's trial sees its own epoch number and figures; at
    each epoch's end, `ended(runs)` ends the trials whose last epoch it was (and refills their
    slots, in a program that refills) and says whether the fit should stop.

    Args:
        program: the program being trained.
        optimizer_state: whether the trials' models get their optimizers' state at each
            epoch end (for callbacks or tuner hooks that read it), or their weights alone.
        ended: `ended(runs)`, see above.
        begin: `begin(params)`, called as the fit begins with its `params`: the trials begin
            there (a program that does not refill), not as they load.
    """

    def __init__(
        self,
        program: Program,
        optimizer_state: bool,
        ended: Callable[[list[TrialRun]], bool],
        begin: Callable[[dict], None] | None = None,
    ) -> None:
        super().__init__()
        self.program = program
        self.optimizer_state = optimizer_state
        self.ended = ended
        self.begin = begin

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.begin is not None:
            self.begin(dict(self.params or {}))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        for run in self.program.runs:
            run.begin_epoch(run.next_epoch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # The fused engine's member models are refreshed from its stacked weights, so
        # checkpoints and callbacks see this epoch's weights; their optimizers' state only
        # when a callback or a tuner hook of the user's may read it (checkpoints hold
        # weights alone).
        runs = self.program.runs
        optimizer_state = self.optimizer_state or any(run.callbacks for run in runs)
        members = self.program.pack.refresh_members(optimizer_state=optimizer_state)
        ended = []
        for run in runs:
            run.end_epoch(run.next_epoch, logs, members[run.index])
            run.next_epoch += 1
            if run.model.stop_training or run.next_epoch >= run.last_epoch:
                ended.append(run)
        if self.ended(ended):
            self.model.stop_training = True


class ProgramEpochWithBatches(ProgramEpoch):
    """`ProgramEpoch` that also forwards train-batch events to each slot's trial."""

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        for run in self.program.runs:
            run.begin_batch(batch, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        for run in self.program.runs:
            run.end_batch(batch, logs)


def own_training(model: keras.Model) -> str:
    """The training methods `model`'s class overrides, which a pack would not call."""
    names = ("fit", "train_step", "test_step", "compute_loss")
    own = [f"`{n}`" for n in names if getattr(type(model), n) is not getattr(keras.Model, n)]
    return ", ".join(own)


def run_alone(
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


def not_trained(error: BaseException) -> dict[str, str]:
    """The path of a trial whose model could not be built."""
    return {"path": "not trained", "why": f"building its model raised {error_line(error)}"}


def pack_label(runs: list[TrialRun], fit_kwargs: dict) -> str:
    """The pack's trials, e.g. `"trials 3, 4, 7 (batch size 64)"`."""
    trial_ids = list(dict.fromkeys(run.trial.trial_id for run in runs))
    label = f"trial{'s' if len(trial_ids) > 1 else ''} {', '.join(trial_ids)}"
    details = []
    if len(runs) > len(trial_ids):
        details.append(f"{len(runs)} models")
    batch_size = trial_batch_size(runs[0], fit_kwargs)
    if batch_size is not None:
        details.append(f"batch size {batch_size}")
    start = trial_start(runs[0], fit_kwargs)
    if start:
        details.append(f"from epoch {start}")
    return f"{label} ({', '.join(details)})" if details else label


def in_trials(text: str, runs: Sequence[TrialRun | None]) -> str:
    """`text` (the planner's, or a pack's error) with the pack's member numbers as the
    trials they belong to (`runs`: each member's, `None` for a free slot, which keeps its
    number)."""
    executions = any(r is not None and r.execution for r in runs)

    def name(i: int) -> str:
        run = runs[i] if i < len(runs) else None
        if run is None:
            return f"member {i}"
        if executions:
            return f"trial {run.trial.trial_id} (execution {run.execution})"
        return f"trial {run.trial.trial_id}"

    def names(match: re.Match) -> str:
        return ", ".join(name(int(i)) for i in match.group(1).split(", "))

    return re.sub(r"\b[Mm]embers? (\d+(?:, \d+)*)", names, text)


def pack_path(pack: ModelPack, runs: list[TrialRun], trial_id: str, label: str) -> dict[str, str]:
    """Where the pack's planner put trial `trial_id`'s models, and why (`label`: the pack's,
    from `pack_label`).

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
    whys.extend(in_trials(plan.reasons[i], runs).rstrip(".") for i in graph)
    if groups:
        path["path"] = "mixed" if graph else "fused"
        path["group"] = "; ".join(groups)
    path["why"] = "; ".join(dict.fromkeys(whys))
    return path


def prepare_trial(calls: TrialCalls, trial: Trial, fit_kwargs: dict) -> list[TrialRun]:
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


def trial_batch_size(run: TrialRun, fit_kwargs: dict) -> Any:
    return run.trial.hyperparameters.values.get("batch_size", fit_kwargs.get("batch_size"))


def trial_start(run: TrialRun, fit_kwargs: dict) -> int:
    """The epoch the trial's `fit` starts from: Hyperband's, else the search's."""
    values = run.trial.hyperparameters.values
    return values.get("tuner/initial_epoch", fit_kwargs.get("initial_epoch", 0))


def round_groups(runs: list[TrialRun], fit_kwargs: dict) -> list[list[TrialRun]]:
    """Packs: one per batch size and start epoch, split by last epoch where that pays.

    Within a pack, `ModelPack`'s planner (`fuse="auto"`) fuses trials of one skeleton into
    groups (padding widths and depths, per-member activations and optimizer families) and
    trains what does not fuse on the graph engine, all in one step. See `_by_length` for
    trials of different lengths.
    """
    by_key: dict[tuple, list[TrialRun]] = defaultdict(list)
    for run in runs:
        by_key[(repr(trial_batch_size(run, fit_kwargs)), trial_start(run, fit_kwargs))].append(run)
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
    start = trial_start(runs[0], fit_kwargs)
    longest = max(run.last_epoch for run in runs)
    needed = sum(max(run.last_epoch - start, 0) for run in runs)
    if len(runs) * (longest - start) <= 2 * needed:
        return [runs]
    by_length: dict[int, list[TrialRun]] = defaultdict(list)
    for run in runs:
        by_length[run.last_epoch].append(run)
    return list(by_length.values())


def compile_args(models: list[keras.Model], batch_hooks: bool) -> dict:
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


def with_split(path: dict[str, str], split: str | None) -> dict[str, str]:
    """`path`, noting the failed pack `split` that made its trial train alone, if any."""
    return path if split is None else {**path, "split": split}
