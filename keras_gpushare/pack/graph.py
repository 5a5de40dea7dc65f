"""The `graph` engine: every member's forward, backward and update in one traced step.

Each member's step sits in its own conditional, so a frozen or stopped member costs no
computation, and the branches are independent sub-graphs the runtime can overlap. This module
is TensorFlow-specific (it is what `ModelPack.train_step` runs on the TensorFlow backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf
from keras import tree
from keras.src.losses.loss import unscale_loss_for_distribution

from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack import replicas
from keras_gpushare.pack.logs import pack_logs
from keras_gpushare.pack.members import ACTIVE, FROZEN_NAN

if TYPE_CHECKING:
    from keras_gpushare.pack.model import ModelPack


def _batch_size(x: Any) -> tf.Tensor:
    return tf.shape(tree.flatten(x)[0])[0]


def _all_finite(loss: tf.Tensor, grads: list) -> tf.Tensor:
    checks = [tf.reduce_all(tf.math.is_finite(loss))]
    checks += [tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None]
    return tf.reduce_all(tf.stack(checks))


def _forward_backward(member: keras.Model, batch: tuple) -> tuple[Any, tf.Tensor, list, list]:
    """One member's training forward and backward: `(y_pred, loss, variables, grads)`."""
    x, y, sample_weight = batch
    with tf.GradientTape() as tape:
        y_pred = member(x, training=True)
        loss = member.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
    variables = member.trainable_variables
    return y_pred, loss, variables, tape.gradient(loss, variables)


def _train_member(pack: ModelPack, member: keras.Model, batch: tuple) -> tf.Tensor:
    """One member's forward, backward and update; returns its new status code."""
    y_pred, loss, variables, grads = _forward_backward(member, batch)

    def update() -> tf.Tensor:
        member.optimizer.apply(grads, variables)
        _update_metrics(member, batch, y_pred, loss)
        return tf.constant(ACTIVE, tf.int32)

    if pack._on_nan != "freeze":
        return update()
    return tf.cond(_all_finite(loss, grads), update, lambda: tf.constant(FROZEN_NAN, tf.int32))


def _update_metrics(member: keras.Model, batch: tuple, y_pred: Any, loss: tf.Tensor) -> None:
    x, y, sample_weight = batch
    member._loss_tracker.update_state(
        unscale_loss_for_distribution(loss), sample_weight=_batch_size(x)
    )
    member.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def train_step(pack: ModelPack, data: Any) -> dict[str, tf.Tensor]:
    """The graph engine's training step: per-member steps, then the pack's logs."""
    if replicas.replica_context() is not None:
        return _replicated_train_step(pack, data)
    batches = data_lib.member_batches(pack, data, training=True)
    status = tf.convert_to_tensor(pack._status.value)
    new_status = []
    for i, (member, batch) in enumerate(zip(pack._members, batches)):
        run = tf.equal(status[i], ACTIVE) & tf.greater(_batch_size(batch[0]), 0)
        new_status.append(
            tf.cond(
                run,
                lambda m=member, b=batch: _train_member(pack, m, b),
                lambda s=status[i]: s,
            )
        )
    new_status = tf.stack(new_status)
    pack._status.assign(new_status)
    pack.optimizer.iterations.assign_add(1)
    return pack_logs(pack._members)


def _replicated_train_step(pack: ModelPack, data: Any) -> dict[str, tf.Tensor]:
    """The training step on one replica of a `tf.distribute` strategy.

    A member's optimizer all-reduces its gradients, which cannot happen inside a conditional
    that only some replicas take. So every member runs forward and backward (a frozen or
    stopped member too); then all replicas agree on which members have data and finite
    values, and the updates run in conditionals that every replica takes alike.
    """
    batches = data_lib.member_batches(pack, data, training=True)
    status = tf.convert_to_tensor(pack._status.value)
    steps, not_finite, rows = [], [], []
    for member, batch in zip(pack._members, batches):
        y_pred, loss, variables, grads = _forward_backward(member, batch)
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        steps.append((y_pred, loss, pairs))
        not_finite.append(tf.logical_not(_all_finite(loss, grads)))
        rows.append(_batch_size(batch[0]))
    not_finite = replicas.any_replica(tf.stack(not_finite))
    rows = replicas.all_replicas_sum(tf.cast(tf.stack(rows), tf.float32))
    run = tf.equal(status, ACTIVE) & tf.greater(rows, 0.0)
    freeze = pack._on_nan == "freeze"
    apply = run & tf.logical_not(not_finite) if freeze else run
    updates = [
        lambda grads, m=member, p=pairs: m.optimizer.apply(grads, [v for _, v in p])
        for member, (_, _, pairs) in zip(pack._members, steps)
    ]
    replicas.run_where(
        tf.unstack(apply), updates, [([g for g, _ in pairs],) for _, _, pairs in steps]
    )
    for i, (member, batch, (y_pred, loss, _)) in enumerate(zip(pack._members, batches, steps)):
        tf.cond(
            apply[i],
            lambda m=member, b=batch, p=y_pred, v=loss: _update_metrics(m, b, p, v),
            lambda: None,
        )
    if freeze:
        status = tf.where(run & not_finite, FROZEN_NAN, status)
    pack._status.assign(status)
    pack.optimizer.iterations.assign_add(1)
    return pack_logs(pack._members)


def test_step(pack: ModelPack, data: Any) -> dict[str, tf.Tensor]:
    """The graph engine's evaluation step: every member is evaluated on the whole batch."""
    for member, (x, y, sample_weight) in zip(
        pack._members, data_lib.member_batches(pack, data, training=False)
    ):
        y_pred = member(x, training=False)
        loss = member.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        _update_metrics(member, (x, y, sample_weight), y_pred, loss)
    return pack_logs(pack._members)
