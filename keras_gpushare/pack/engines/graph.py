"""The graph engine: every member's forward, backward and update in one traced step.

Each member's step sits in its own conditional, so a frozen or stopped member costs no
computation, and the branches are independent sub-graphs the runtime can overlap. Members may
differ in anything (architecture, inputs, outputs, losses); each keeps its own Keras
optimizer. This engine is TensorFlow's: it updates its members itself inside the pack's step.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import tree

from keras_gpushare import _upstream
from keras_gpushare.pack import _replicas
from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack._status import ACTIVE, FROZEN_NAN
from keras_gpushare.pack.engines.base import GroupFigures, SteppingEngine


def _batch_size(x: Any) -> tf.Tensor:
    return tf.shape(tree.flatten(x)[0])[0]


def _all_finite(loss: tf.Tensor, grads: list) -> tf.Tensor:
    checks = [tf.reduce_all(tf.math.is_finite(loss))]
    checks += [tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None]
    return tf.reduce_all(tf.stack(checks))


def _forward_backward(member: keras.Model, batch: tuple) -> tuple[Any, tf.Tensor, list, list]:
    """One member's training forward and backward: `(y_pred, loss, variables, grads)`.

    As Keras's own step does, the loss is scaled by the member's optimizer before the
    gradient (mixed precision: its `LossScaleOptimizer` unscales the gradients); the loss
    returned is unscaled.
    """
    x, y, sample_weight = batch
    with tf.GradientTape() as tape:
        y_pred = member(x, training=True)
        loss = member.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        scaled = member.optimizer.scale_loss(loss)
    variables = member.trainable_variables
    return y_pred, loss, variables, tape.gradient(scaled, variables)


def _finite(member: keras.Model, loss: tf.Tensor, grads: list) -> tf.Tensor:
    """Whether the member's step is sound: its loss, and its gradients unless its
    optimizer scales the loss (a `LossScaleOptimizer` skips non-finite gradients itself)."""
    if isinstance(member.optimizer, keras.optimizers.LossScaleOptimizer):
        return _all_finite(loss, [])
    return _all_finite(loss, grads)


def _update_metrics(member: keras.Model, batch: tuple, y_pred: Any, loss: tf.Tensor) -> None:
    x, y, sample_weight = batch
    _upstream.loss_tracker(member).update_state(
        _upstream.unscale_loss_for_distribution(loss), sample_weight=_batch_size(x)
    )
    member.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class GraphEngine(SteppingEngine):
    """Members of any architectures, each stepped by its own optimizer in one traced step.

    Args:
        members: the member models, in `member_ids` order.
        member_ids: each member's position in the pack.
        options: the pack's `EngineOptions`.
    """

    kind = "graph"
    default_steps_per_execution = 16

    def keras_objects(self) -> list:
        return list(self.members)

    @property
    def metrics(self) -> list:
        result = []
        for member in self.members:
            result.extend(member.metrics)
        return result

    def call(self, inputs: Any, training: bool | None = None, active: Any = None) -> list:
        return [
            member(data_lib.member_inputs(inputs, member), training=training)
            for member in self.members
        ]

    def member_outputs(self, raw: Any) -> list:
        return raw

    def describe(self, index: int) -> str:
        return "graph engine"

    def _batches(self, data: Any, training: bool) -> list[tuple[Any, Any, Any]]:
        return data_lib.member_batches(
            data,
            self.members,
            self.member_ids,
            self.options.output_counts,
            shard=training and self.options.data_mode == "shard",
        )

    def _train_member(self, member: keras.Model, batch: tuple) -> tf.Tensor:
        """One member's forward, backward and update; returns its new status code."""
        y_pred, loss, variables, grads = _forward_backward(member, batch)

        def update() -> tf.Tensor:
            member.optimizer.apply(grads, variables)
            _update_metrics(member, batch, y_pred, loss)
            return tf.constant(ACTIVE, tf.int32)

        if self.options.on_nan != "freeze":
            return update()
        return tf.cond(
            _finite(member, loss, grads), update, lambda: tf.constant(FROZEN_NAN, tf.int32)
        )

    def train(self, data: Any, status: tf.Tensor) -> tf.Tensor:
        if _replicas.replica_context() is not None:
            return self._replicated_train(data, status)
        new_status = []
        for j, (member, batch) in enumerate(zip(self.members, self._batches(data, True))):
            run = tf.equal(status[j], ACTIVE) & tf.greater(_batch_size(batch[0]), 0)
            new_status.append(
                tf.cond(
                    run,
                    lambda m=member, b=batch: self._train_member(m, b),
                    lambda s=status[j]: s,
                )
            )
        return tf.stack(new_status)

    def _replicated_train(self, data: Any, status: tf.Tensor) -> tf.Tensor:
        """The training step on one replica of a `tf.distribute` strategy.

        A member's optimizer all-reduces its gradients, which cannot happen inside a
        conditional that only some replicas take. So every member runs forward and backward
        (a frozen or stopped member too); then all replicas agree on which members have data
        and finite values, and the updates run in conditionals that every replica takes alike.
        """
        batches = self._batches(data, True)
        steps, not_finite, rows = [], [], []
        for member, batch in zip(self.members, batches):
            y_pred, loss, variables, grads = _forward_backward(member, batch)
            pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
            steps.append((y_pred, loss, pairs))
            not_finite.append(tf.logical_not(_finite(member, loss, grads)))
            rows.append(_batch_size(batch[0]))
        not_finite = _replicas.any_replica(tf.stack(not_finite))
        rows = _replicas.all_replicas_sum(tf.cast(tf.stack(rows), tf.float32))
        run = tf.equal(status, ACTIVE) & tf.greater(rows, 0.0)
        freeze = self.options.on_nan == "freeze"
        apply = run & tf.logical_not(not_finite) if freeze else run
        updates = [
            lambda grads, m=member, p=pairs: m.optimizer.apply(grads, [v for _, v in p])
            for member, (_, _, pairs) in zip(self.members, steps)
        ]
        _replicas.run_where(
            tf.unstack(apply), updates, [([g for g, _ in pairs],) for _, _, pairs in steps]
        )
        for j, (member, batch, (y_pred, loss, _)) in enumerate(zip(self.members, batches, steps)):
            tf.cond(
                apply[j],
                lambda m=member, b=batch, p=y_pred, v=loss: _update_metrics(m, b, p, v),
                lambda: None,
            )
        if freeze:
            status = tf.where(run & not_finite, FROZEN_NAN, status)
        return status

    def test(self, data: Any) -> None:
        for member, (x, y, sample_weight) in zip(self.members, self._batches(data, False)):
            y_pred = member(x, training=False)
            loss = member.compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            )
            _update_metrics(member, (x, y, sample_weight), y_pred, loss)

    def figures(self) -> GroupFigures:
        losses, ran, own = [], [], []
        for member in self.members:
            ran.append(tf.greater(_upstream.loss_tracker(member).count, 0))
            items = dict(member.get_metrics_result())
            loss = items.pop("loss", _upstream.loss_tracker(member).result())
            losses.append(tf.cast(loss, "float32"))
            own.append(items)
        return GroupFigures(tf.stack(losses), tf.stack(ran), {}, own)
