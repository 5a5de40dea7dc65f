"""The pack's steps on TensorFlow, and its build before them, as a mixin of `ModelPack`.

Keras mixes its backend's trainer into `keras.Model` (`TensorFlowTrainer` on TensorFlow);
`ModelPack` mixes `TensorFlowSteps` in on that backend the same way. Keras's own
`train_step` serves packs whose members the pack's optimizer updates (gradient engines,
every backend). When a group trains on a stepping engine (the graph engine, which steps each
member with its own optimizer inside the step), the pack's step is written here: the
gradient engines' forward, loss, gradient and vectorized update as Keras's TensorFlow step
does them, then each stepping engine's own step, in one traced function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_gpushare import _upstream
from keras_gpushare.pack._loop._pack_internals import PackInternals
from keras_gpushare.pack._replicas import multi_worker_logs
from keras_gpushare.pack._status import ACTIVE
from keras_gpushare.pack.fusion import VectorizedOptimizer

if TYPE_CHECKING:
    # Mixed into `ModelPack`, before `keras.Model`: `super()` is Keras's trainer.
    from keras import Model as _Model

    from keras_gpushare.pack.engines.base import GradientEngine, SteppingEngine
else:
    _Model = object


class TensorFlowSteps(_Model):
    """`train_step`, `test_step` and the build before the first step of a `ModelPack` on
    TensorFlow (Keras calls `_maybe_symbolic_build` on TensorFlow only).

    The pack provides `_gradient_engines` and `_stepping_engines` (its engines of each
    kind), `_gradient_variables()` (the variables its optimizer updates), `_status` (the
    member status variable), `_logs()` (its logs from the engines' figures), `_members`,
    `_distributed()` and `_symbolic_build(iterator, data_batch, members)`.
    """

    if TYPE_CHECKING:
        _gradient_engines: list[GradientEngine]
        _stepping_engines: list[SteppingEngine]
        _members: Sequence[keras.Model]
        _status: keras.Variable

        def _gradient_variables(self) -> list: ...

        def _logs(self) -> dict: ...

        def _distributed(self) -> bool: ...

        def _symbolic_build(
            self, iterator: Any = None, data_batch: Any = None, members: Any = None
        ) -> None: ...

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> None:
        if self._distributed() and iterator is not None and data_batch is None:
            # Keras reduces the first distributed batch over the replicas only to learn its
            # shapes, which fails for an (x, y) batch under MultiWorkerMirroredStrategy; one
            # replica's share has the shapes.
            for batches in _upstream.epoch_iterator_data(iterator):
                data_batch = tree.map_structure(self._first_replica_value, next(batches))
                break
        elif not self._distributed():
            # Keras leaves building to the first trace of the step, and TensorFlow traces a
            # function that makes variables twice; a pack's step is large, so the members'
            # state is made here, before the first trace, and the step is traced once. A
            # graph-engine member's optimizer is built in a trace of its own, as its own
            # `fit` builds it (see `_build_optimizer_as_fit_does`); a member that is not
            # built yet builds in the step's trace, as in its own `fit`.
            stepping = {i for engine in self._stepping_engines for i in engine.member_ids}
            ready = [
                i
                for i, member in enumerate(self._members)
                if i not in stepping or _build_optimizer_as_fit_does(member)
            ]
            if data_batch is None and iterator is not None:
                # From the batches' shapes: reading one would start an epoch of the data
                # (a `PyDataset`'s workers would load batches that plain `fit` never asks
                # for, and hand the first epoch some of them).
                data_batch = _symbolic_batch(_upstream.epoch_iterator_element_spec(iterator))
            self._symbolic_build(iterator=iterator, data_batch=data_batch, members=ready)
            return
        _upstream.maybe_symbolic_build(super(), data_batch)

    def _first_replica_value(self, value: Any) -> Any:
        if isinstance(value, tf.distribute.DistributedValues):
            return self.distribute_strategy.experimental_local_results(value)[0]
        return value

    def train_step(self, data: Any) -> dict[str, tf.Tensor]:
        """One training step of every engine; returns the pack's logs (shaped for several
        workers: `_replicas.multi_worker_logs`)."""
        if not self._stepping_engines:
            return multi_worker_logs(super().train_step(data))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        engines = self._gradient_engines
        if engines:
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x, y, y_pred, sample_weight, training=True)
                loss = self.optimizer.scale_loss(loss)
            variables = self._gradient_variables()
            self.optimizer.apply(tape.gradient(loss, variables), variables)
            for engine, raw in zip(engines, y_pred):
                engine.update_metrics(y, raw, sample_weight)
        else:
            self.optimizer.iterations.assign_add(1)
        status = tf.convert_to_tensor(self._status.value)
        for stepping in self._stepping_engines:
            ids = list(stepping.member_ids)
            codes = stepping.train(data, tf.gather(status, ids))
            status = tf.tensor_scatter_nd_update(status, [[i] for i in ids], codes)
        self._status.assign(status)
        return multi_worker_logs(self._logs())

    def test_step(self, data: Any) -> dict[str, tf.Tensor]:
        """One evaluation step of every engine on the whole batch; returns the pack's logs
        (shaped for several workers, as `train_step`'s)."""
        if not self._stepping_engines:
            return multi_worker_logs(super().test_step(data))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        engines = self._gradient_engines
        if engines:
            raws = tuple(engine.call(x, training=False) for engine in engines)
            self.compute_loss(x, y, raws, sample_weight, training=False)
            for engine, raw in zip(engines, raws):
                engine.update_metrics(y, raw, sample_weight)
        for stepping in self._stepping_engines:
            stepping.test(data)
        return multi_worker_logs(self._logs())


def count_failed_step(pack: PackInternals) -> None:
    """Counts a training call that raised as a step in the `iterations` of each member
    whose own `fit` would have counted it.

    Keras's TensorFlow step of one batch a call (what a member's own `fit` runs with
    `steps_per_execution` 1, its default) adds one to `iterations` without waiting for the
    batch: when the data raises, the failed step is counted though no update was applied,
    and a later `fit` continues from that count (Adam's bias correction, schedules). The
    pack counts applied steps only; this adds the failed one for each active member, when
    the pack was compiled with `steps_per_execution` 1 or `"auto"` (a member alone runs one
    batch a call) and the member's optimizer does not scale its loss (Keras's
    `LossScaleOptimizer` counts inside a condition on the gradients, so only applied steps).
    """
    given = (pack._member_compile_args or {}).get("steps_per_execution", "auto")
    if given not in ("auto", 1):
        return
    active = keras.ops.convert_to_numpy(pack._status.value) == ACTIVE
    counted = [
        i
        for i, member in enumerate(pack._members)
        if active[i] and not isinstance(member.optimizer, keras.optimizers.LossScaleOptimizer)
    ]
    stepping = {i for engine in pack._stepping_engines for i in engine.member_ids}
    fused = np.zeros((len(pack._members),), "int32")
    for i in counted:
        if i in stepping:
            _upstream.iterations_variable(pack._members[i].optimizer).assign_add(1)
        else:
            fused[i] = 1
    if fused.any() and isinstance(pack.optimizer, VectorizedOptimizer):
        pack.optimizer.member_iterations.assign_add(fused)


def _build_optimizer_as_fit_does(member: keras.Model) -> bool:
    """Builds a built `member`'s optimizer inside a traced function that is never run;
    returns whether the optimizer is built (False when the member is not built yet).

    A member's own `fit` on TensorFlow builds its optimizer in the first trace of its step,
    which TensorFlow then discards and traces again (a function that makes variables is
    traced twice): the optimizer's variables are made with their initial values, and what
    its `build` assigns in that trace never runs (`ScheduleFreeAdamW` copies the weights
    into its momentum there, so a plain `fit` starts the momentum at zeros). Here the
    variables are made at once, outside the trace, and `build`'s other operations are
    traced and dropped: the same state, and the pack's step, the largest function of the
    `fit`, is traced once.
    """
    optimizer = member.optimizer
    if optimizer is None or optimizer.built:
        return True
    if not member.built:
        return False
    variables = member.trainable_variables

    def build() -> None:
        if optimizer.built:  # traced again after TensorFlow lifted a variable out of it
            return
        scope = keras.name_scope(optimizer.name, caller=optimizer)
        with tf.variable_creator_scope(_made_outside_the_trace), scope:
            optimizer.build(variables)
        optimizer.built = True

    tf.function(build, autograph=False).get_concrete_function()
    return True


def _made_outside_the_trace(next_creator: Any, **kwargs: Any) -> tf.Variable:
    """A variable creator making a variable whose initial value is a function (Keras's
    initializers) eagerly; one given a value computed in the trace (`Adafactor`'s
    placeholders) TensorFlow lifts out of it, as in a plain `fit`."""
    if not callable(kwargs.get("initial_value")):
        return next_creator(**kwargs)
    kwargs["experimental_enable_variable_lifting"] = False
    with tf.init_scope():
        return next_creator(**kwargs)


def _symbolic_batch(spec: Any) -> Any:
    """Symbolic tensors shaped as the batches `spec` (`tf.TensorSpec`s) describes, or None
    when it holds other kinds (ragged, sparse) or is None."""
    if spec is None:
        return None
    leaves = tree.flatten(spec)
    if not all(type(leaf) is tf.TensorSpec for leaf in leaves):
        return None
    return tree.map_structure(
        lambda leaf: keras.KerasTensor(tuple(leaf.shape), leaf.dtype.name), spec
    )
