"""The pack's steps on TensorFlow when some engine updates its members itself.

Keras's own `train_step` serves packs whose members the pack's optimizer updates (fused
groups, every backend). When a group trains on the graph engine, which steps each member with
its own optimizer inside the step, the pack's step is written here: the fused groups' forward,
loss, gradient and vectorized update as Keras's TensorFlow step does them, then each graph
group's own step, in one traced function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

if TYPE_CHECKING:
    from keras_gpushare.pack.model import ModelPack


def train_step(pack: ModelPack, data: Any) -> dict[str, tf.Tensor]:
    """One training step of every engine; returns the pack's logs."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    engines = pack._gradient_engines
    if engines:
        with tf.GradientTape() as tape:
            y_pred = pack(x, training=True)
            loss = pack.compute_loss(x, y, y_pred, sample_weight, training=True)
            loss = pack.optimizer.scale_loss(loss)
        variables = pack._gradient_variables()
        pack.optimizer.apply(tape.gradient(loss, variables), variables)
        for engine, raw in zip(engines, y_pred):
            engine.update_metrics(y, raw, sample_weight)
    else:
        pack.optimizer.iterations.assign_add(1)
    status = tf.convert_to_tensor(pack._status.value)
    for engine in pack._stepping_engines:
        ids = list(engine.member_ids)
        codes = engine.train(data, tf.gather(status, ids))
        status = tf.tensor_scatter_nd_update(status, [[i] for i in ids], codes)
    pack._status.assign(status)
    return pack._logs()


def test_step(pack: ModelPack, data: Any) -> dict[str, tf.Tensor]:
    """One evaluation step of every engine on the whole batch; returns the pack's logs."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    engines = pack._gradient_engines
    if engines:
        raws = tuple(engine.call(x, training=False) for engine in engines)
        pack.compute_loss(x, y, raws, sample_weight, training=False)
        for engine, raw in zip(engines, raws):
            engine.update_metrics(y, raw, sample_weight)
    for engine in pack._stepping_engines:
        engine.test(data)
    return pack._logs()
