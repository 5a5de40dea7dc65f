"""`ModelPack`: N Keras models trained concurrently inside one `model.fit`."""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack import (
    _batch_calls,
    _chief,
    _compile_args,
    _fit_args,
    _replicas,
    _slots,
    planner,
)
from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack import members as members_lib
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack._gc_freeze import OldObjectsFrozen
from keras_gpushare.pack._jit_policy import JitPolicy
from keras_gpushare.pack._logs import pack_logs
from keras_gpushare.pack._member_callbacks import per_member_callbacks
from keras_gpushare.pack._optimizers import MemberOptimizers
from keras_gpushare.pack._status import ACTIVE, FROZEN_NAN, STATUS_NAMES, STOPPED_EARLY
from keras_gpushare.pack._summary import member_params, pack_summary
from keras_gpushare.pack._watcher import StatusWatcher
from keras_gpushare.pack.engines.base import Engine, EngineOptions, GradientEngine, SteppingEngine
from keras_gpushare.pack.fusion import VectorizedOptimizer
from keras_gpushare.pack.fusion import base as fusion_base

if BACKEND.own_steps:
    # The pack's steps on TensorFlow, as Keras mixes in its `TensorFlowTrainer`.
    from keras_gpushare.pack._tf_steps import TensorFlowSteps

    _BACKEND_STEPS: tuple[type, ...] = (TensorFlowSteps,)
else:
    _BACKEND_STEPS = ()

logger = logging.getLogger(__name__)

_FUSE_VALUES = ("auto", True, False)
_ON_NAN_VALUES = ("freeze", "ignore")


@keras.saving.register_keras_serializable(package="keras_gpushare")
class ModelPack(*_BACKEND_STEPS, keras.Model):  # type: ignore[misc]  # (mypy: bases by backend)
    """Trains N Keras models concurrently inside one `model.fit`.

    A `ModelPack` is a `keras.Model` whose training step trains every member: each member
    keeps its own optimizer (state, learning rate, schedule), loss and metrics, and appears in
    the logs as `m{i}_loss`, `m{i}_<metric>` and `val_m{i}_...`; `loss` is the mean over the
    members still training. Callbacks (`EarlyStopping(monitor="val_m2_loss")`, `CSVLogger`,
    `TensorBoard`, `ModelCheckpoint`, `BackupAndRestore`) work unchanged.

    The `graph` engine puts every member's forward, backward and update into one traced step,
    so members may differ in architecture, inputs, outputs and losses. A member whose loss or
    gradients stop being finite is frozen at its last finite weights while the others go on
    (`on_nan="freeze"`); `pack.status` says which members are still training.

    Args:
        members: list of `keras.Model` instances (Sequential, Functional or subclassed;
            built or not). Each must be its own object.
        data: `"replicate"` (every member sees each batch: ensembles, tuning) or `"shard"`
            (member `i` trains on rows `i, i+N, ...` of each training batch, the seeds'
            `x[i::n]`; evaluation and prediction always use the whole batch). Defaults to
            `"replicate"`.
        fuse: `"auto"`, `True` or `False`: whether to fuse same-architecture members into
            stacked-weight kernels. Defaults to `"auto"`.
        on_nan: `"freeze"` (stop updating a member whose loss or gradients are not finite)
            or `"ignore"` (apply its update anyway, as a plain `fit` would). Defaults to
            `"freeze"`.
        name: name of the pack model. Defaults to `None`.

    Example:

    ```python
    import numpy as np
    import keras
    import keras_gpushare as kg

    def build(width):
        return keras.Sequential(
            [keras.Input((10,)), keras.layers.Dense(width, activation="relu"),
             keras.layers.Dense(1, activation="sigmoid")]
        )

    pack = kg.ModelPack([build(w) for w in (8, 16, 32)])
    pack.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    x = np.random.rand(256, 10).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 5).astype("float32")
    history = pack.fit(x, y, batch_size=32, epochs=2, verbose=0)
    print(sorted(history.history))   # loss, m0_accuracy, m0_loss, m1_accuracy, ...
    best = pack.member(2)            # a standalone keras.Model, saveable with .save()
    ```
    """

    def __init__(
        self,
        members: Sequence[keras.Model],
        data: str = "replicate",
        fuse: str | bool = "auto",
        on_nan: str = "freeze",
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        members = members_lib.check_members(members)
        data = data_lib.check_data_mode(data)
        if fuse not in _FUSE_VALUES:
            raise ValueError(
                f'Invalid value for argument `fuse`: got {fuse!r}. Expected "auto", True or False.'
            )
        if on_nan not in _ON_NAN_VALUES:
            raise ValueError(
                f'Invalid value for argument `on_nan`: got {on_nan!r}. Expected "freeze" or '
                '"ignore".'
            )
        groups = kwargs.pop("groups", None)
        # Fused layers hold their members' settings as data, so `load_member` takes models
        # of other widths, activations and dropout rates (the tuner's slots).
        slot_mode = bool(kwargs.pop("_slot_values", False))
        with fusion_base.slot_values(slot_mode):
            plan = planner.plan_engines(members, fuse, data, groups=groups)
        super().__init__(name=name, **kwargs)
        self._members = _fit_args.Items(members)
        self._data_mode = data
        self._fuse = fuse
        self._jit_policy: JitPolicy | None = None
        self._on_nan = on_nan
        self._fusion_report = plan
        self._options = EngineOptions(
            tuple(data_lib.output_count(m) for m in members), on_nan=on_nan, data_mode=data
        )
        self._slot_values = slot_mode
        with fusion_base.slot_values(self._slot_values):
            self._set_engines(planner.build_engines(plan, members, self._options))
        self._status = self.add_weight(
            name="member_status",
            shape=(len(members),),
            dtype="int32",
            initializer=fusion_base.host_zeros,
            trainable=False,
            # Replicas of a tf.distribute strategy agree on the status (_replicas.py); any
            # replica's value is the one to keep.
            aggregation="only_first_replica",
        )
        self._member_compile_args: dict[str, Any] | None = None
        self._loss_scale = None
        self._auto_steps = False
        if all(m.built for m in members):
            self.built = True
        logger.info("ModelPack %s: %s", self.name, plan)

    def _set_engines(self, engines: list[Engine]) -> None:
        """Holds `engines` and tracks their Keras objects (weights, saving) as the pack's."""
        for layer in getattr(self, "_engine_layers", ()):
            _upstream.untrack_layer(self, layer)
        self._engines = _fit_args.Items(engines)
        self._engine_layers = [obj for engine in engines for obj in engine.keras_objects()]

    @classmethod
    def from_builder(cls, build_fn: Callable[..., keras.Model], n: int, **kwargs: Any) -> ModelPack:
        """Builds a pack of `n` members from `build_fn(i)` (or `build_fn()`).

        Args:
            build_fn: a function returning a new `keras.Model`; it receives the member index
                when it takes an argument.
            n: number of members.
            **kwargs: passed to `ModelPack` (`data`, `fuse`, `on_nan`, `name`).

        Returns:
            A `ModelPack`.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(
                f"Invalid value for argument `n`: got {n!r}. Expected a positive integer."
            )
        if not callable(build_fn):
            raise TypeError(
                f"Invalid value for argument `build_fn`: got {type(build_fn).__name__}, "
                "expected a function returning a keras.Model."
            )
        takes_index = bool(inspect.signature(build_fn).parameters)
        members = [build_fn(i) if takes_index else build_fn() for i in range(n)]
        return cls(members, **kwargs)

    # Structure ---------------------------------------------------------------------------

    @property
    def members(self) -> list[keras.Model]:
        """The member models, holding the pack's current weights.

        Members the graph engine trains are the models themselves; fused members are
        refreshed from the stacked weights (and optimizer state) each time this is read.
        """
        return self._refreshed_members(optimizer_state=True)

    def _refreshed_members(self, optimizer_state: bool) -> list[keras.Model]:
        """The members holding the current weights, and the optimizer state if asked."""
        optimizer = getattr(self, "optimizer", None) if optimizer_state else None
        for engine in self._engines:
            engine.sync_members(optimizer)
        return list(self._members)

    @property
    def engine(self) -> str:
        """The engine that trains this pack: `"fused"`, `"graph"` or `"mixed"`."""
        kinds = {engine.kind for engine in self._engines}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def fusion_report(self) -> str:
        """Why the members were or were not fused, layer by layer."""
        return str(self._fusion_report)

    @property
    def engine_plan(self) -> planner.EnginePlan:
        """The planner's `EnginePlan`: the fused groups' members (`groups`), the graph
        engine's (`graph`), why each of those is not fused (`reasons`) and each group's
        padding share (`waste`); `fusion_report` is its text."""
        return self._fusion_report

    @property
    def status(self) -> list[str]:
        """Each member's state: `"active"`, `"frozen:nan"`, `"stopped:early"`, `"failed"`."""
        codes = keras.ops.convert_to_numpy(self._status.value)
        return [STATUS_NAMES[int(c)] for c in codes]

    def count_params(self) -> int:
        """The members' own parameters, as N separate models hold them.

        The fused engine's stacked weights hold more (members padded to the widest), which
        `summary()` shows; a layer two members share is counted once.
        """
        return member_params(self._members)

    def summary(
        self,
        line_length: int | None = None,
        positions: Sequence[float] | None = None,
        print_fn: Callable[..., Any] | None = None,
        expand_nested: bool = False,
        show_trainable: bool = False,
        layer_range: Sequence[str] | None = None,
    ) -> None:
        """Prints one row per member: its model, where it trains, output shape, parameters,
        optimizer and status; with `expand_nested=True`, each member's own `summary()` after
        it (given the other arguments, as `keras.Model.summary` takes them)."""
        places = []
        for i in range(len(self._members)):
            engine, _ = self._locate(i)
            same_kind = [e for e in self._engines if type(e) is type(engine)]
            places.append(engine.describe(same_kind.index(engine)))
        pack_summary(
            self.name,
            self.members,
            places,
            self.status,
            stored=member_params([self], trainable=True),
            print_fn=print_fn,
            expand_nested=expand_nested,
            line_length=line_length,
            positions=positions,
            show_trainable=show_trainable,
            layer_range=layer_range,
        )

    def stop_member(self, index: int) -> None:
        """Stops training member `index` (its weights stay as they are now)."""
        self._set_member_status(index, STOPPED_EARLY)

    def load_member(self, index: int, model: keras.Model) -> None:
        """Loads `model` into member `index`, which then trains as `model` would from now.

        The member takes `model`'s weights and learning rate, a fresh optimizer state (step
        count, slots, loss scale), zeroed metrics and the status `"active"`; the pack's
        compiled step is kept, so the next `fit` (or the next epoch, when called from a
        callback) starts at once. `model` must match the member but for its values: the
        same layers and settings, loss and metrics, and optimizer but for its learning
        rate. `model` itself is not trained: read the result with `pack.member(index)`.

        Args:
            index: the member.
            model: a built, compiled `keras.Model` whose optimizer has not taken a step.

        Raises:
            ValueError: `model` differs from the member (the message says where), or its
                optimizer has state that loading would drop.
        """
        problem = self.load_problem(index, model)
        if problem is not None:
            raise ValueError(
                f"Cannot load model `{model.name}` into member {index} of ModelPack "
                f"{self.name}: {problem}. A loaded model may differ from the member only in "
                "its values (weights and learning rate); build a new ModelPack for others."
            )
        engine, j = self._locate(index)
        engine.load_member(j, model, self.optimizer)
        members = list(self._members)
        members[index] = engine.occupant(j)
        self._members = _fit_args.Items(members)
        self._set_member_status(index, ACTIVE)

    def load_problem(self, index: int, model: keras.Model) -> str | None:
        """Why `load_member(index, model)` would refuse `model`, or `None` when it loads.

        Raises:
            TypeError: `model` is not a `keras.Model`.
            ValueError: `index` is not a member, or the pack is not compiled.
        """
        self._check_index(index)
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"Invalid value for argument `model`: expected a `keras.Model`, got "
                f"{type(model).__name__}."
            )
        if not self.compiled:
            raise ValueError(
                "This ModelPack is not compiled: `load_member` keeps a compiled pack's step. "
                "Compile the pack first, or pass the model to `ModelPack([...])`."
            )
        if not model.built:
            return "it is not built; call it on data or `build` it"
        engine, j = self._locate(index)
        problem = engine.load_problem(j, model, self.optimizer)
        steps = _slots.steps_taken(model.optimizer)
        if problem is None and steps:
            problem = (
                f"its optimizer has taken {steps} steps, and loading starts the member's "
                "optimizer afresh; recompile the model, or build a new `ModelPack([...])`, "
                "which carries an optimizer's state"
            )
        return problem

    def reset_member(self, index: int) -> None:
        """Restarts member `index`'s optimizer and metrics, keeping its weights.

        Its step count, optimizer slots, loss scale and metrics start again as after
        `compile`, its learning rate is the one it was compiled (or loaded) with, and its
        status becomes `"active"`.

        Args:
            index: the member.
        """
        self._check_index(index)
        if not self.compiled:
            raise ValueError("This ModelPack is not compiled: compile it before `reset_member`.")
        engine, j = self._locate(index)
        engine.reset_member(j, self.optimizer)
        self._set_member_status(index, ACTIVE)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._members):
            raise ValueError(
                f"Invalid member index {index}: this pack has {len(self._members)} members "
                f"(0 to {len(self._members) - 1})."
            )

    def _set_member_status(self, index: int, code: int) -> None:
        self._check_index(index)
        codes = keras.ops.convert_to_numpy(self._status.value).copy()
        codes[index] = code
        self._status.assign(codes)
        self._sync_member_mask()

    def _sync_member_mask(self) -> None:
        """The vectorized optimizer updates exactly the members whose status is active.

        With `on_nan="ignore"` it applies non-finite steps as Keras does, so it can no longer
        tell a stopped member by its (deliberately non-finite) gradients.
        """
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, VectorizedOptimizer):
            codes = keras.ops.convert_to_numpy(self._status.value)
            optimizer.member_mask.assign((codes == ACTIVE).astype("float32"))

    def member(self, index: int) -> keras.Model:
        """Returns a standalone copy of member `index`: weights, compile settings, optimizer state.

        The copy shares nothing with the pack and can be saved with `.save("m.keras")`.
        """
        self._check_index(index)
        return members_lib.standalone_copy(self.members[index])

    def _locate(self, index: int) -> tuple[Engine, int]:
        """The engine training member `index`, and the member's position in it."""
        for engine in self._engines:
            if index in engine.member_ids:
                return engine, engine.member_ids.index(index)
        raise ValueError(f"Invalid member index {index}.")

    def _get_member_weights(self, index: int) -> list[np.ndarray]:
        engine, j = self._locate(index)
        return engine.get_member_weights(j)

    def _set_member_weights(self, index: int, weights: list[np.ndarray]) -> None:
        engine, j = self._locate(index)
        engine.set_member_weights(j, weights)

    def build(self, input_shape: Any = None) -> None:
        self.built = True

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The members' outputs: a list of N (member order), or raw per-engine ones in training.

        In training the outputs go to `compute_loss` as each engine produced them (a fused
        group's stacked output, say), one entry per engine the pack's optimizer updates.
        """
        if training:
            active = ops.equal(ops.convert_to_tensor(self._status), ACTIVE)
            return tuple(
                engine.call(inputs, training=True, active=ops.take(active, engine.member_ids))
                for engine in self._gradient_engines
            )
        outputs: list = [None] * len(self._members)
        for engine in self._engines:
            raw = engine.call(inputs, training=training)
            for i, output in zip(engine.member_ids, engine.member_outputs(raw)):
                outputs[i] = output
        return outputs

    @property
    def _gradient_engines(self) -> list[GradientEngine]:
        """The engines whose members the pack's optimizer updates from the summed loss."""
        return [engine for engine in self._engines if isinstance(engine, GradientEngine)]

    @property
    def _stepping_engines(self) -> list[SteppingEngine]:
        """The engines that update their members themselves in the pack's step."""
        return [engine for engine in self._engines if isinstance(engine, SteppingEngine)]

    def _engine_outputs(self, y_pred: Any) -> list:
        """Each gradient engine's share of `y_pred` (raw in training, or the member list)."""
        if isinstance(y_pred, tuple):
            return list(y_pred)
        return [[y_pred[i] for i in engine.member_ids] for engine in self._gradient_engines]

    # Compile -----------------------------------------------------------------------------

    def compile(
        self,
        optimizer: Any = None,
        loss: Any = None,
        loss_weights: Any = None,
        metrics: Any = None,
        weighted_metrics: Any = None,
        run_eagerly: bool = False,
        steps_per_execution: int | str = "auto",
        jit_compile: bool | str = "auto",
        auto_scale_loss: bool = True,
    ) -> None:
        """Configures every member for training.

        `optimizer`, `loss`, `metrics` and `weighted_metrics` take one value for all members
        or a list with one value per member. One optimizer is copied per member (each keeps
        its own state); a list must hold a distinct optimizer for each member. An argument
        left at `None` keeps what each member was compiled with before it joined the pack
        (`pack.compile()` alone compiles every member as it was).

        Args:
            optimizer: optimizer name or instance, or a list of one per member. Defaults to
                `None`: each member's own optimizer (state included), or `"rmsprop"` for a
                member that was not compiled.
            loss: loss for all members, or a list of one per member. Defaults to `None`:
                each member's own loss (every member must then have been compiled).
            loss_weights: as in `keras.Model.compile`, for every member. Defaults to `None`.
            metrics: metrics for all members (`["mae"]`) or one list per member
                (`[["mae"], ["mse"]]`). Defaults to `None`.
            weighted_metrics: as `metrics`, weighted by sample weights. Defaults to `None`.
            run_eagerly: run steps eagerly (debugging). Defaults to `False`.
            steps_per_execution: batches per compiled call. `"auto"` picks 64 on the fused
                engine and 16 on the graph engine (measured best for small members on
                CPU), which hides Keras's per-call overhead, except in a `fit`, `evaluate` or
                `predict` given a callback that acts on every batch (batch hooks, an integer
                `save_freq` or `update_freq`): those run one batch per call, as Keras's
                default does, so the callback sees every batch. Given `steps_per_epoch`,
                `validation_steps` or `steps`, a call runs a number of batches dividing
                them, so an epoch takes exactly those steps. Under a `tf.distribute`
                strategy it must be 1 (`"auto"` picks 1). Defaults to `"auto"`.
            jit_compile: XLA compilation. `"auto"` decides by what XLA pays back: on JAX
                and on TensorFlow with a GPU the fused engine compiles with XLA; on a
                TensorFlow CPU `fit` starts without XLA and compiles the training step with
                it once the steps left in the `fit` repay the compile time (docs/fusion.md,
                "Compile defaults"); torch, convolutions and pooling on a TensorFlow CPU,
                eager steps and `tf.distribute` strategies run without it. The graph engine
                follows Keras's rule (XLA with a GPU only). Defaults to `"auto"`.
            auto_scale_loss: as in `keras.Model.compile` (mixed precision): each member
                scales its own loss dynamically. Defaults to `True`.
        """
        args = _compile_args.member_args(
            self._members,
            optimizer,
            loss,
            loss_weights,
            metrics,
            weighted_metrics,
            run_eagerly,
            auto_scale_loss,
        )
        self._compile_members(args, run_eagerly, steps_per_execution, jit_compile)

    def _compile_members(
        self,
        member_args: list[dict],
        run_eagerly: bool,
        steps_per_execution: int | str,
        jit_compile: bool | str,
        loading: bool = False,
    ) -> None:
        """Compiles each member with its arguments, then the pack around them.

        The optimizers' variables are made at once when a file's state is to be loaded into
        them, or when a member's optimizer already holds state (it trained before joining
        the pack); otherwise, as in Keras, at the first step.
        """
        for member, args in zip(self._members, member_args):
            member.compile(**args)
        pack_optimizer = self._pack_optimizer([m.optimizer for m in self._members])
        for engine in self._engines:
            engine.configure([member_args[i] for i in engine.member_ids])
        distributed = self._distributed()
        self._auto_steps = steps_per_execution == "auto"
        if self._auto_steps:
            resolved_steps: int | str = 1 if distributed else self._default_steps_per_execution()
        elif distributed and steps_per_execution != 1:
            raise ValueError(
                f"Invalid value for argument `steps_per_execution`: got {steps_per_execution!r} "
                "under a tf.distribute strategy. Keras's multi-step loop fails under "
                "MirroredStrategy (keras-team/keras#19246), so a pack under a strategy runs one "
                'step per call: pass steps_per_execution=1 or "auto".'
            )
        else:
            resolved_steps = steps_per_execution
        resolved_jit = jit_compile
        self._jit_policy = None
        if jit_compile == "auto" and not self._stepping_engines:
            supported = not run_eagerly and not distributed and self._members_support_jit()
            self._jit_policy = JitPolicy.for_pack(supported)
            resolved_jit = self._jit_policy.initial
        super().compile(
            optimizer=pack_optimizer,
            loss=None,
            run_eagerly=run_eagerly,
            steps_per_execution=resolved_steps,
            jit_compile=resolved_jit,
            # Each member scales its own loss (see VectorizedOptimizer.attach_loss_scale).
            auto_scale_loss=False,
        )
        self._attach_loss_scale()
        self._sync_member_mask()
        self._member_compile_args = {
            "members": member_args,
            "run_eagerly": run_eagerly,
            "steps_per_execution": steps_per_execution,
            "jit_compile": jit_compile,
        }
        member_state = any(m.optimizer.built for m in self._members)
        if (loading or member_state) and self.built and all(m.built for m in self._members):
            self._build_member_state()

    def _pack_optimizer(self, optimizers: list) -> keras.optimizers.Optimizer:
        """The optimizer Keras sees: vectorized over fused groups, or the members' own.

        A fused member whose optimizer has no vectorized form moves to the graph engine
        (on TensorFlow with `fuse="auto"`; elsewhere it is an error naming it).
        """
        unsupported = planner.optimizer_moves(self._engines, self._members, optimizers)
        if unsupported:
            self._move_to_graph(unsupported)
        engines = self._gradient_engines
        if not engines:
            return MemberOptimizers(optimizers)
        optimizer = VectorizedOptimizer(
            optimizers,
            groups=[engine.member_ids for engine in engines],
            skip_nonfinite=self._on_nan == "freeze",
            slot_values=self._slot_values,
        )
        optimizer.set_variable_groups(
            [
                (variable, g)
                for g, engine in enumerate(engines)
                for layer in engine.keras_objects()
                for variable in layer.trainable_variables
            ]
        )
        return optimizer

    def _move_to_graph(self, reasons: dict[int, str]) -> None:
        """Moves fused members whose optimizers cannot be vectorized to the graph engine,
        or raises where the graph engine cannot take them."""
        reason = next(iter(reasons.values()))
        if self._fuse is True or not BACKEND.graph_engine:
            raise ValueError(
                f"Invalid value for argument `optimizer`: {reason} The fused engine cannot "
                "train it; the graph engine can, on the TensorFlow backend with "
                'fuse="auto" or fuse=False.'
            )
        if self.compiled:
            raise ValueError(
                f"Invalid value for argument `optimizer`: {reason} This pack was compiled "
                "with these members fused before; build a new pack to train them."
            )
        with fusion_base.slot_values(self._slot_values):
            engines = planner.move_to_graph(
                self._fusion_report,
                list(self._members),
                list(self._engines),
                {
                    i: f"not fused: its optimizer cannot be vectorized: {r}"
                    for i, r in reasons.items()
                },
                self._options,
            )
        self._set_engines(engines)
        message = (
            f"ModelPack {self.name}: members {sorted(reasons)} train on the graph engine, "
            f"not fused: {next(iter(reasons.values()))}"
        )
        logger.warning(message)
        warnings.warn(message, stacklevel=3)

    def _distributed(self) -> bool:
        """Whether this pack trains under a `tf.distribute` strategy."""
        if not BACKEND.distribute_strategies:
            return False
        import tensorflow as tf

        return tf.distribute.has_strategy() or _upstream.model_strategy(self) is not None

    def _members_support_jit(self) -> bool:
        """Whether XLA pays for this pack: for every engine's group (each engine's rule)."""
        return all(engine.supports_jit() for engine in self._gradient_engines)

    def _default_steps_per_execution(self) -> int:
        """Batches per compiled call for `steps_per_execution="auto"`: the least that any
        of the pack's engines asks for; one on torch, whose Keras trainer runs one batch
        per call."""
        if BACKEND.one_batch_per_call:
            return 1
        return min(engine.default_steps_per_execution for engine in self._engines)

    def get_compile_config(self) -> dict:
        if self._member_compile_args is None:
            return {}
        return keras.saving.serialize_keras_object(self._member_compile_args)

    def compile_from_config(self, config: dict) -> None:
        config = keras.saving.deserialize_keras_object(config)
        if "members" not in config:
            # Written by keras-gpushare 0.1: one list per argument.
            config["members"] = _compile_args.member_args(
                self._members,
                config["optimizer"],
                config["loss"],
                config["loss_weights"],
                config["metrics"],
                config["weighted_metrics"],
                config["run_eagerly"],
                config["auto_scale_loss"],
            )
        self._compile_members(
            config["members"],
            config["run_eagerly"],
            config["steps_per_execution"],
            config["jit_compile"],
            loading=True,
        )

    def _build_member_state(self) -> None:
        """Creates the optimizer variables of the members that step themselves (of every
        member under a `tf.distribute` strategy), and the pack optimizer's.

        A member's optimizer that already holds state (the member trained before it joined
        the pack) hands that state to the pack's optimizer, so training continues from it.
        """
        for i in self._members_building_optimizers():
            member = self._members[i]
            if not member.optimizer.built:
                member.optimizer.build(member.trainable_variables)
        if not self.optimizer.built:
            self.optimizer.build(self._gradient_variables())
            for engine in self._gradient_engines:
                engine.read_optimizer_state(self.optimizer)

    def _members_building_optimizers(self) -> set[int]:
        """The members whose own optimizers are built with the pack: those that step
        themselves, and every member under a strategy (whose variables must be made in its
        scope). A fused member's optimizer is otherwise built when its state is read."""
        if self._distributed():
            return set(range(len(self._members)))
        return {i for engine in self._stepping_engines for i in engine.member_ids}

    def _gradient_variables(self) -> list:
        """The trainable variables the pack's optimizer updates, in Keras's order.

        The fused groups' stacked weights and the members' loss scales: Keras hands the
        pack's optimizer `trainable_variables` in this order on every backend.
        """
        ids = {
            id(variable)
            for engine in self._gradient_engines
            for layer in engine.keras_objects()
            for variable in layer.trainable_variables
        }
        if self._loss_scale is not None:
            ids.add(id(self._loss_scale))
        return [v for v in self.trainable_variables if id(v) in ids]

    @property
    def metrics(self) -> list:
        result = []
        for engine in self._engines:
            result.extend(engine.metrics)
        return result

    def _symbolic_build(
        self, iterator: Any = None, data_batch: Any = None, members: Any = None
    ) -> None:
        """Builds the pack, and the state of `members` (positions; default all) and of
        the fused groups, from one batch of data."""
        if (
            data_batch is None
            and iterator is not None
            and _fit_args.needs_a_batch([self, *self._members])
        ):
            for data_or_iterator in _upstream.epoch_iterator_data(iterator):
                if isinstance(data_or_iterator, (list, tuple)):
                    data_batch = data_or_iterator[0]
                else:
                    data_batch = next(data_or_iterator)
                break
        if data_batch is not None:
            n = len(self._members)
            batches = data_lib.member_batches(
                data_batch, self._members, range(n), self._options.output_counts, shard=False
            )
            eager = self._members_building_optimizers()
            for i, (member, batch) in enumerate(zip(self._members, batches)):
                if members is None or i in members:
                    members_lib.build_member(member, batch, build_optimizer=i in eager)
            # A member loaded by values before the first step: its engine keeps the loss
            # and metrics of the member it was built with, which must be built too.
            for engine in self._gradient_engines:
                for i in engine.loaded_by_values():
                    if members is None or i in members:
                        original = engine.members[list(engine.member_ids).index(i)]
                        members_lib.build_member(original, batches[i], build_optimizer=False)
            if self.compiled:
                y = keras.utils.unpack_x_y_sample_weight(data_batch)[1]
                for engine in self._gradient_engines:
                    engine.build_metric_states(y)
        self.built = True
        if self.optimizer is not None and not self.optimizer.built:
            # The variables the step hands the optimizer: not the graph engine's members'.
            self.optimizer.build(self._gradient_variables())
        _upstream.symbolic_build(super(), data_batch)

    def _check_labels(self, x: Any, y: Any) -> None:
        """Raises, naming the member, when a member cannot take the inputs or the labels."""
        _fit_args.check_inputs(x, self._members, self._gradient_engines)
        self._options.output_counts = tuple(data_lib.output_count(m) for m in self._members)
        _fit_args.check_labels(x, y, self._members, self._options.output_counts)

    def evaluate(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Evaluates every member on the whole data; same arguments as `keras.Model.evaluate`.

        Without `return_dict=True` the result is a list in the order of `metrics_names`:
        `loss` (the members' mean), then each member's figures (`m0_loss`, `m0_mae`, ...).
        """
        if not kwargs.get("_use_cached_eval_dataset"):
            # Not the validation inside `fit`, whose labels `fit` checked.
            self._check_labels(x, y)
        return_dict = kwargs.pop("return_dict", False)
        given = _fit_args.call_arguments("evaluate", x, y, args, kwargs)
        counts, verbose = [given["steps"]], given["verbose"]
        callbacks = kwargs.pop("callbacks", None)
        frozen = OldObjectsFrozen(self.test_function is None)
        with frozen, _fit_args.steps_for(self, self._auto_steps, callbacks, counts):
            logs = super().evaluate(
                x,
                y,
                *args,
                return_dict=True,
                callbacks=_fit_args.with_progress_bar(len(self._members), callbacks, verbose),
                **kwargs,
            )
        if return_dict:
            return logs
        names = self.metrics_names
        values = [logs[k] for k in names if k in logs] + [
            v for k, v in logs.items() if k not in names
        ]
        return values[0] if len(values) == 1 else values

    @property
    def metrics_names(self) -> list[str]:
        """The names of the pack's figures, in the order `evaluate` returns them."""
        return list(self._logs())

    # Steps -------------------------------------------------------------------------------

    def make_train_function(self, force: bool = False) -> Any:
        """Keras's training function, leaving a call whose data raises as plain `fit`
        leaves it (see `_batch_calls.keeping_failed_steps`)."""
        fresh = force or self.train_function is None
        super().make_train_function(force)
        if fresh:
            self.train_function: Any = _batch_calls.keeping_failed_steps(self, self.train_function)
        return self.train_function

    def train_step(self, *args: Any) -> Any:
        return _replicas.multi_worker_logs(super().train_step(*args))

    def test_step(self, *args: Any) -> Any:
        return _replicas.multi_worker_logs(super().test_step(*args))

    def compute_loss(
        self,
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: Any = None,
        training: bool = True,
    ) -> Any:
        """The sum of the active members' own losses (their compiled losses and penalties).

        Members the pack's optimizer updates contribute; a member whose loss is not finite
        is frozen (`on_nan="freeze"`). Like Keras's own losses, the total is divided by the
        number of replicas under a `tf.distribute` strategy.
        """
        status = ops.convert_to_tensor(self._status)
        new_status = status
        scales = self._loss_scales() if training else None
        total = ops.convert_to_tensor(0.0)
        engines = self._gradient_engines
        for engine, raw in zip(engines, self._engine_outputs(y_pred)):
            current = ops.take(status, engine.member_ids)
            losses, freeze = engine.loss(x, y, raw, sample_weight, current, training)
            if scales is not None:
                losses = losses * ops.take(scales, engine.member_ids)
            total = total + ops.sum(losses)
            if training:
                new_status = ops.scatter_update(
                    new_status,
                    [[i] for i in engine.member_ids],
                    ops.where(freeze, FROZEN_NAN, current),
                )
        if training and engines:
            self._status.assign(new_status)
        return _upstream.scale_loss_for_distribution(total)

    def _loss_scales(self) -> Any:
        """Each member's loss scale in training (fixed factor times dynamic scale), or None.

        The gradient of the scaled loss with respect to the dynamic scale is the member's
        loss: the vectorized optimizer reads from it which members trained this step.
        """
        optimizer = self.optimizer
        if not isinstance(optimizer, VectorizedOptimizer):
            return None
        factors = optimizer.loss_scale_factors()
        if self._loss_scale is None:
            return None if np.all(factors == 1.0) else ops.convert_to_tensor(factors)
        return ops.convert_to_tensor(factors) * ops.convert_to_tensor(self._loss_scale)

    def _attach_loss_scale(self) -> None:
        """Gives the members' dynamic loss scales (mixed precision) a variable, when needed."""
        optimizer = self.optimizer
        if not isinstance(optimizer, VectorizedOptimizer) or not optimizer.uses_dynamic_loss_scale:
            return
        if self._loss_scale is None:
            self._loss_scale = self.add_weight(
                name="member_loss_scale",
                shape=(len(self._members),),
                initializer=keras.initializers.Constant(optimizer.initial_loss_scales()),
                trainable=True,
            )
        optimizer.attach_loss_scale(self._loss_scale)

    def _learning_rate_handle(self, index: int) -> Any:
        """What sets member `index`'s learning rate (`MemberView.optimizer`)."""
        engine, j = self._locate(index)
        return engine.learning_rate_handle(j, self.optimizer)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> dict:
        """Updates every member's metrics and returns the pack's logs (`m{i}_<name>`)."""
        for engine, raw in zip(self._gradient_engines, self._engine_outputs(y_pred)):
            engine.update_metrics(y, raw, sample_weight)
        return self._logs()

    def _logs(self) -> dict:
        groups = [(engine.member_ids, engine.figures()) for engine in self._engines]
        return pack_logs(groups, len(self._members))

    # Fit / predict -----------------------------------------------------------------------

    def fit(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Trains every member; same arguments and return value as `keras.Model.fit`.

        Keras callbacks written for one model act on each member as in a fit of its own:
        `EarlyStopping` and `ReduceLROnPlateau` watching a figure every member has
        (`"val_loss"`) and `LearningRateScheduler` run once per member (see
        `MemberEarlyStopping`); a monitor naming one member's figure (`"val_m2_loss"`)
        acts on the whole pack.
        """
        if not self.compiled:
            raise RuntimeError(
                "You must call `compile()` on the ModelPack before `fit()`: "
                'pack.compile(optimizer="adam", loss="mse").'
            )
        self._check_labels(x, y)
        validation = kwargs.get("validation_data")
        if isinstance(validation, (list, tuple)) and len(validation) >= 2:
            self._check_labels(validation[0], validation[1])
        if self._data_mode == "shard":
            _fit_args.check_shardable(x, len(self._members))
        self._sync_member_mask()
        callbacks = list(kwargs.pop("callbacks", None) or [])
        callbacks = per_member_callbacks(_chief.chief_callbacks(self, callbacks))
        callbacks.append(StatusWatcher(list(callbacks)))
        if self._jit_policy is not None:
            callbacks.extend(self._jit_policy.callbacks())
        given = _fit_args.call_arguments("fit", x, y, args, kwargs)
        counts = [given["steps_per_epoch"]]
        if given["validation_data"] is not None or given["validation_split"]:
            counts.append(given["validation_steps"])
        frozen = OldObjectsFrozen(self.train_function is None)
        callbacks.append(frozen.callback())
        clash = _replicas.collective_clash_explained()
        with frozen, _fit_args.steps_for(self, self._auto_steps, callbacks, counts), clash:
            history = super().fit(
                x,
                y,
                *args,
                callbacks=_fit_args.with_progress_bar(
                    len(self._members), callbacks, given["verbose"]
                ),
                **kwargs,
            )
        if all(m.built for m in self._members):
            self.built = True
        return history

    def predict(self, x: Any, *args: Any, stack: bool = False, **kwargs: Any) -> Any:
        """Predicts with every member: a list of N outputs, or one array with `stack=True`.

        Args:
            x: inputs, as for `keras.Model.predict`.
            *args: passed to `keras.Model.predict`.
            stack: return one array with a leading member axis instead of a list.
                Defaults to `False`.
            **kwargs: passed to `keras.Model.predict`.

        Returns:
            A list with member `i`'s predictions at index `i`, or a stacked array.
        """
        _fit_args.check_inputs(x, self._members, self._gradient_engines)
        given = _fit_args.call_arguments("predict", x, None, args, kwargs)
        counts, verbose = [given["steps"]], given["verbose"]
        callbacks = kwargs.pop("callbacks", None)
        frozen = OldObjectsFrozen(self.predict_function is None)
        with frozen, _fit_args.steps_for(self, self._auto_steps, callbacks, counts):
            outputs = super().predict(
                x,
                *args,
                callbacks=_fit_args.with_progress_bar(len(self._members), callbacks, verbose),
                **kwargs,
            )
        if not stack:
            return outputs
        shapes = {tuple(np.shape(o)) for o in outputs}
        if len(shapes) != 1 or isinstance(outputs[0], (list, dict)):
            raise ValueError(
                "Invalid value for argument `stack`: members' predictions have different "
                f"shapes or structures ({sorted(shapes)}), so they cannot be stacked. Call "
                "`predict` with `stack=False` to get one array per member."
            )
        return np.stack(outputs)

    # Serialization -----------------------------------------------------------------------

    def save(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Saves the pack as `keras.Model.save` does; under several workers, the chief's only.

        Under `MultiWorkerMirroredStrategy` call it on every worker (as for any Keras model
        there): the chief writes `filepath`, the other workers write nothing that stays.
        """
        loaded = [i for e in self._engines for i in e.loaded_by_values()]
        if loaded:
            raise ValueError(
                f"ModelPack {self.name} cannot be saved whole: members {sorted(loaded)} were "
                "loaded by values into slots their fused layers were built for, which the "
                "members' configs no longer describe. Save each member with "
                "`pack.member(i).save(...)`, or the weights with `pack.save_weights(...)`."
            )
        with _chief.chief_path(self, filepath) as path:
            super().save(path, *args, **kwargs)

    def save_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Saves the weights as `keras.Model.save_weights` does; under several workers, once.

        As `save`: on every worker, and only the chief's file stays.
        """
        sharded = kwargs.get("max_shard_size", args[1] if len(args) > 1 else None) is not None
        with _chief.chief_path(self, filepath, whole=not sharded) as path:
            super().save_weights(path, *args, **kwargs)

    def get_config(self) -> dict:
        return {
            "name": self.name,
            "members": [keras.saving.serialize_keras_object(m) for m in self._members],
            "data": self._data_mode,
            "fuse": self._fuse,
            "on_nan": self._on_nan,
            "engine": self.engine,
            "groups": [list(engine.member_ids) for engine in self._gradient_engines],
            "_slot_values": self._slot_values,
        }

    @classmethod
    def from_config(cls, config: dict) -> ModelPack:
        config = dict(config)
        config["members"] = [keras.saving.deserialize_keras_object(m) for m in config["members"]]
        engine = config.pop("engine", None)
        if "groups" not in config:
            # Written by keras-gpushare 0.1: one engine for all members.
            n = len(config["members"])
            config["groups"] = [list(range(n))] if engine == "fused" else []
        # The saved weights have the saved plan's layout: rebuild exactly that plan.
        return cls(**config)
