"""`ModelPack`: N Keras models trained concurrently inside one `model.fit`."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack import _compiling, _loop, planner
from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack import members as members_lib
from keras_gpushare.pack._member_access import MemberAccess
from keras_gpushare.pack.engines.base import Engine, EngineOptions, GradientEngine, SteppingEngine
from keras_gpushare.pack.fusion import base as fusion_base
from keras_gpushare.pack.fusion import settings as fusion_settings

logger = logging.getLogger(__name__)

_FUSE_VALUES = ("auto", True, False)
_ON_NAN_VALUES = ("freeze", "ignore")


@keras.saving.register_keras_serializable(package="keras_gpushare")
class ModelPack(*_loop.BACKEND_STEPS, MemberAccess, keras.Model):  # type: ignore[misc]  # (mypy: bases by backend)
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
            `x[i::n]`; evaluation and prediction always use the whole batch; on JAX and
            torch, where the members fuse, every training batch must split evenly).
            Defaults to `"replicate"`.
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
        # `_slot_values=True`: fused layers and the optimizer hold their members' settings
        # as data, so `load_member` takes models of other widths, activations, dropout
        # rates and optimizers (the tuner's slots); constants of the step otherwise.
        held = kwargs.pop("_slot_values", False)
        settings = fusion_settings.HELD if held else fusion_settings.CONSTANTS
        # `data="shard"` fused on TensorFlow too (the tuner's programs, whose batches always
        # split evenly among the members; elsewhere it fuses anyway).
        fused_shard = bool(kwargs.pop("_fused_shard", False))
        plan = planner.plan_engines(
            members, fuse, data, groups=groups, fused_shard=fused_shard, settings=settings
        )
        super().__init__(name=name, **kwargs)
        self._members = _loop.Items(members)
        self._data_mode = data
        self._fuse = fuse
        self._jit_policy: _compiling.JitPolicy | None = None
        self._on_nan = on_nan
        self._fusion_report = plan
        self._options = EngineOptions(
            tuple(data_lib.output_count(m) for m in members), on_nan=on_nan, data_mode=data
        )
        self._settings = settings
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
        self._engines = _loop.Items(engines)
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
    def engine(self) -> str:
        """The engine that trains this pack: `"fused"`, `"graph"` or `"mixed"`."""
        kinds = {engine.kind for engine in self._engines}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def fusion_report(self) -> str:
        """Why the members were or were not fused, layer by layer; once the pack has
        trained or evaluated, what of the members' losses and metrics each fused group's
        step computes member by member, and why."""
        lines = [str(self._fusion_report)]
        fused = [engine for engine in self._engines if engine.kind == "fused"]
        for k, engine in enumerate(fused):
            lines.extend(f"group {k}'s step: {note}" for note in engine.step_notes())
        return "\n".join(lines)

    @property
    def engine_plan(self) -> planner.EnginePlan:
        """The planner's `EnginePlan`: the fused groups' members (`groups`), the graph
        engine's (`graph`), why each of those is not fused (`reasons`) and each group's
        padding share (`waste`); `fusion_report` is its text."""
        return self._fusion_report

    def build(self, input_shape: Any = None) -> None:
        self.built = True

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The members' outputs: a list of N (member order), or raw per-engine ones in training.

        In training the outputs go to `compute_loss` as each engine produced them (a fused
        group's stacked output, say), one entry per engine the pack's optimizer updates.
        """
        if training:
            active = self._active_members()
            return tuple(
                engine.call(inputs, training=True, active=engine.member_rows(active))
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
        args = _compiling.member_args(
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
        engines = list(self._engines)
        resolved_steps = _compiling.steps_per_execution(steps_per_execution, distributed, engines)
        resolved_jit, self._jit_policy = _compiling.jit_compile(
            jit_compile, run_eagerly, distributed, engines
        )
        super().compile(
            optimizer=pack_optimizer,
            loss=None,
            run_eagerly=run_eagerly,
            steps_per_execution=resolved_steps,
            jit_compile=resolved_jit,
            # Each member scales its own loss (see VectorizedOptimizer.attach_loss_scale).
            auto_scale_loss=False,
        )
        self._loss_scale = _compiling.attach_loss_scale(
            self.optimizer, self._loss_scale, self.add_weight, len(self._members)
        )
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
        """The optimizer Keras sees (see `_compiling._optimizer_choice`), after moving the
        fused members whose optimizers have no vectorized form to the graph engine."""
        unsupported = planner.optimizer_moves(self._fusion_report, optimizers)
        if unsupported:
            self._set_engines(
                _compiling.graph_fallback(
                    self.name,
                    unsupported,
                    self._fuse,
                    self.compiled,
                    self._fusion_report,
                    self._members,
                    self._engines,
                    self._options,
                )
            )
        return _compiling.pack_optimizer(
            optimizers,
            self._gradient_engines,
            skip_nonfinite=self._on_nan == "freeze",
            settings=self._settings,
        )

    def _distributed(self) -> bool:
        """Whether this pack trains under a `tf.distribute` strategy."""
        return _compiling.distributed(self)

    def get_compile_config(self) -> dict:
        if self._member_compile_args is None:
            return {}
        return keras.saving.serialize_keras_object(self._member_compile_args)

    def compile_from_config(self, config: dict) -> None:
        config = _compiling.compile_arguments(
            self._members, keras.saving.deserialize_keras_object(config)
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
        member under a `tf.distribute` strategy), and the pack optimizer's."""
        _compiling.build_optimizers(
            list(self._members),
            self._members_building_optimizers(),
            self.optimizer,
            self._gradient_variables(),
            self._gradient_engines,
        )

    def _members_building_optimizers(self) -> set[int]:
        """The members whose own optimizers are built with the pack: those that step
        themselves, and every member under a strategy (whose variables must be made in its
        scope). A fused member's optimizer is otherwise built when its state is read."""
        if self._distributed():
            return set(range(len(self._members)))
        return {i for engine in self._stepping_engines for i in engine.member_ids}

    def _gradient_variables(self) -> list:
        """The trainable variables the pack's optimizer updates, in Keras's order."""
        return _compiling.gradient_variables(
            self.trainable_variables, self._gradient_engines, self._loss_scale
        )

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
        if data_batch is None:
            data_batch = _compiling.first_batch([self, *self._members], iterator)
        if data_batch is not None:
            _compiling.build_from_batch(
                data_batch,
                list(self._members),
                self._gradient_engines,
                self._options.output_counts,
                members,
                self._members_building_optimizers(),
                self.compiled,
            )
        self.built = True
        if self.optimizer is not None and not self.optimizer.built:
            # The variables the step hands the optimizer: not the graph engine's members'.
            self.optimizer.build(self._gradient_variables())
        _upstream.symbolic_build(super(), data_batch)

    def _check_labels(self, x: Any, y: Any) -> None:
        """Raises, naming the member, when a member cannot take the inputs or the labels."""
        _loop.check_inputs(x, self._members, self._gradient_engines)
        self._options.output_counts = tuple(data_lib.output_count(m) for m in self._members)
        _loop.check_labels(x, y, self._members, self._options.output_counts)

    def evaluate(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Evaluates every member on the whole data; same arguments as `keras.Model.evaluate`.

        Without `return_dict=True` the result is a list in the order of `metrics_names`:
        `loss` (the members' mean), then each member's figures (`m0_loss`, `m0_mae`, ...).
        """
        if not kwargs.get("_use_cached_eval_dataset"):
            # Not the validation inside `fit`, whose labels `fit` checked.
            self._check_labels(x, y)
        return_dict = kwargs.pop("return_dict", False)
        given = _loop.call_arguments("evaluate", x, y, args, kwargs)
        counts, verbose = [given["steps"]], given["verbose"]
        callbacks = kwargs.pop("callbacks", None)
        frozen = _loop.OldObjectsFrozen(self.test_function is None)
        with frozen, _loop.steps_for(self, self._auto_steps, callbacks, counts):
            logs = super().evaluate(
                x,
                y,
                *args,
                return_dict=True,
                callbacks=_loop.with_progress_bar(len(self._members), callbacks, verbose),
                **kwargs,
            )
        return logs if return_dict else _loop.evaluate_values(logs, self.metrics_names)

    @property
    def metrics_names(self) -> list[str]:
        """The names of the pack's figures, in the order `evaluate` returns them."""
        return list(self._expanded(self._logs()))

    # Steps -------------------------------------------------------------------------------

    def make_train_function(self, force: bool = False) -> Any:
        """Keras's training function, leaving a call whose data raises as plain `fit`
        leaves it (see `_loop._batch_calls`); on JAX a call of several batches is one
        device loop (`_loop._device_loop`)."""
        fresh = force or self.train_function is None
        super().make_train_function(force)
        if fresh:
            loop = _loop.device_loop(self, self.train_step, keep_failed=True)
            if loop is not None:
                function = loop
            else:
                function = _loop.keeping_failed_steps(self, self.train_function)
            self.train_function: Any = self._returning_member_logs(function)
        return self.train_function

    def make_test_function(self, force: bool = False) -> Any:
        """Keras's test function, returning the pack's `m{i}_` logs (on JAX, a call of
        several batches is one device loop)."""
        fresh = force or self.test_function is None
        super().make_test_function(force)
        if fresh:
            loop = _loop.device_loop(self, self.test_step, keep_failed=False)
            function = self.test_function if loop is None else loop
            self.test_function: Any = self._returning_member_logs(function)
        return self.test_function

    def _returning_member_logs(self, function: Any) -> Any:
        """`function` with the step's stacked logs expanded where its call returns."""
        return _loop.expanding(function, self._expanded)

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
        engines = self._gradient_engines
        total, new_status = _compiling.summed_loss(
            engines,
            self._engine_outputs(y_pred),
            (x, y, sample_weight),
            ops.convert_to_tensor(self._status),
            _compiling.loss_scales(self.optimizer, self._loss_scale) if training else None,
            training,
        )
        if training and engines:
            self._status.assign(new_status)
        return _upstream.scale_loss_for_distribution(total)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> dict:
        """Updates every member's metrics and returns the pack's logs (`m{i}_<name>`)."""
        for engine, raw in zip(self._gradient_engines, self._engine_outputs(y_pred)):
            engine.update_metrics(y, raw, sample_weight)
        return self._logs()

    def _logs(self) -> dict:
        """The step's logs, each group's figures stacked (see `_loop._logs`)."""
        return _loop.step_logs([(engine.member_ids, engine.figures()) for engine in self._engines])

    def _expanded(self, logs: dict) -> dict:
        """The pack's `m{i}_` logs from the step's (see `_loop._logs`)."""
        member_ids = [engine.member_ids for engine in self._engines]
        return _loop.expanded(logs, member_ids, len(self._members))

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
        given = _loop.call_arguments("fit", x, y, args, kwargs)
        if self._data_mode == "shard":
            fused = any(engine.kind == "fused" for engine in self._engines)
            _loop.check_shardable(x, len(self._members), given if fused else None)
        self._sync_member_mask()
        policy = () if self._jit_policy is None else self._jit_policy.callbacks()
        callbacks = _loop.fit_callbacks(self, kwargs.pop("callbacks", None), policy)
        counts = _loop.fit_step_counts(given)
        frozen = _loop.OldObjectsFrozen(self.train_function is None)
        callbacks.append(frozen.callback())
        clash = _loop.collective_clash_explained()
        with frozen, _loop.steps_for(self, self._auto_steps, callbacks, counts), clash:
            history = super().fit(
                x,
                y,
                *args,
                callbacks=_loop.with_progress_bar(len(self._members), callbacks, given["verbose"]),
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
        _loop.check_inputs(x, self._members, self._gradient_engines)
        given = _loop.call_arguments("predict", x, None, args, kwargs)
        counts, verbose = [given["steps"]], given["verbose"]
        callbacks = kwargs.pop("callbacks", None)
        frozen = _loop.OldObjectsFrozen(self.predict_function is None)
        with frozen, _loop.steps_for(self, self._auto_steps, callbacks, counts):
            outputs = super().predict(
                x,
                *args,
                callbacks=_loop.with_progress_bar(len(self._members), callbacks, verbose),
                **kwargs,
            )
        return _loop.stacked_predictions(outputs) if stack else outputs

    # Serialization -----------------------------------------------------------------------

    def save(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Saves the pack as `keras.Model.save` does; under several workers, the chief's only.

        Under `MultiWorkerMirroredStrategy` call it on every worker (as for any Keras model
        there): the chief writes `filepath`, the other workers write nothing that stays.
        """
        _compiling.check_saveable(self.name, self._engines)
        with _compiling.chief_path(self, filepath) as path:
            super().save(path, *args, **kwargs)

    def save_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Saves the weights as `keras.Model.save_weights` does; under several workers, once.

        As `save`: on every worker, and only the chief's file stays.
        """
        sharded = kwargs.get("max_shard_size", args[1] if len(args) > 1 else None) is not None
        with _compiling.chief_path(self, filepath, whole=not sharded) as path:
            super().save_weights(path, *args, **kwargs)

    def get_config(self) -> dict:
        options = {
            "data": self._data_mode,
            "fuse": self._fuse,
            "on_nan": self._on_nan,
            "_slot_values": self._settings.held,
        }
        return _compiling.pack_config(
            self.name, self._members, options, self.engine, self._gradient_engines
        )

    @classmethod
    def from_config(cls, config: dict) -> ModelPack:
        # The saved weights have the saved plan's layout: rebuild exactly that plan.
        return cls(**_compiling.init_arguments(config))
