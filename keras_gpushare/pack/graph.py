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
from keras_gpushare.pack.members import ACTIVE, FROZEN_NAN, STOPPED_EARLY

if TYPE_CHECKING:
    from keras_gpushare.pack.model import ModelPack


def member_batches(pack: ModelPack, data: Any, training: bool) -> list[tuple[Any, Any, Any]]:
    """Splits a pack batch into `(x, y, sample_weight)` for each member."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    n = len(pack._members)
    per_member = data_lib.labels_per_member(y, n)
    batches = []
    for i, member in enumerate(pack._members):
        xi = data_lib.member_inputs(x, member)
        yi = data_lib.member_labels(y, i, per_member)
        swi = data_lib.member_labels(sample_weight, i, per_member and _is_list_of(sample_weight, n))
        if training and pack._data_mode == "shard":
            xi, yi, swi = (data_lib.shard(v, i, n) for v in (xi, yi, swi))
        batches.append((xi, yi, swi))
    return batches


def _is_list_of(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n


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
    batches = member_batches(pack, data, training=True)
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
    return pack_logs(pack, tf.equal(new_status, ACTIVE))


def test_step(pack: ModelPack, data: Any) -> dict[str, tf.Tensor]:
    """The graph engine's evaluation step: every member is evaluated on the whole batch."""
    for member, (x, y, sample_weight) in zip(
        pack._members, member_batches(pack, data, training=False)
    ):
        y_pred = member(x, training=False)
        loss = member.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        member._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
        member.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    status = tf.convert_to_tensor(pack._status.value)
    usable = tf.equal(status, ACTIVE) | tf.equal(status, STOPPED_EARLY)
    return pack_logs(pack, usable, mask_members=False)


def pack_logs(pack: ModelPack, counted: tf.Tensor, mask_members: bool = True) -> dict:
    """`m{i}_<name>` for every member and `loss`, the mean loss of the `counted` members.

    With `mask_members`, a member that is not counted (frozen, stopped) logs NaN, so an epoch
    in which it did not train never shows stale or zero figures.
    """
    logs = {}
    losses = []
    nan = tf.constant(float("nan"))
    for i, member in enumerate(pack._members):
        for name, value in member.get_metrics_result().items():
            value = tf.cast(value, tf.float32)
            if mask_members:
                value = tf.where(counted[i], value, nan)
            logs[f"m{i}_{name}"] = value
        losses.append(tf.cast(member._loss_tracker.result(), tf.float32))
    losses = tf.stack(losses)
    weights = tf.cast(counted, tf.float32)
    count = tf.reduce_sum(weights)
    total = tf.reduce_sum(tf.where(counted, losses, tf.zeros_like(losses)))
    mean = tf.where(count > 0, tf.math.divide_no_nan(total, count), nan)
    return {"loss": mean, **logs}
