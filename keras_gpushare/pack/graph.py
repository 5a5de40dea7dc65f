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

from keras_gpushare.pack import data as data_lib
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


def _train_member(pack: ModelPack, member: keras.Model, batch: tuple) -> tf.Tensor:
    """One member's forward, backward and update; returns its new status code."""
    x, y, sample_weight = batch
    with tf.GradientTape() as tape:
        y_pred = member(x, training=True)
        loss = member.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
    variables = member.trainable_variables
    grads = tape.gradient(loss, variables)

    def update() -> tf.Tensor:
        member.optimizer.apply(grads, variables)
        member._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
        member.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return tf.constant(ACTIVE, tf.int32)

    if pack._on_nan != "freeze":
        return update()
    return tf.cond(_all_finite(loss, grads), update, lambda: tf.constant(FROZEN_NAN, tf.int32))


def train_step(pack: ModelPack, data: Any) -> dict[str, tf.Tensor]:
    """The graph engine's training step: per-member steps, then the pack's logs."""
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


def test_step(pack: ModelPack, data: Any) -> dict[str, tf.Tensor]:
    """The graph engine's evaluation step: every member is evaluated on the whole batch."""
    for member, (x, y, sample_weight) in zip(
        pack._members, data_lib.member_batches(pack, data, training=False)
    ):
        y_pred = member(x, training=False)
        loss = member.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        member._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
        member.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return pack_logs(pack._members)
