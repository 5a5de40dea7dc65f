"""Batches that do not cut into equal micro-batches train as the unsplit model does.

A batch of `B >= M` rows is cut into micro-batches of `B // M` or one row more, each
micro-batch's loss weighed by its rows, so the summed gradient is the full batch's (the
torchgpipe transparency test, on uneven micro-batches). Only a batch of fewer than `M`
rows is refused, and only when `fit` reaches it.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from placement_models import CASES, data, mlp

import keras_gpushare as kg

DEVICES = ["/CPU:1", "/CPU:2"]


def _rows(n):
    rng = np.random.RandomState(7)
    x = rng.randn(n, 6).astype("float32")
    y = rng.randn(n, 3).astype("float32")
    sample_weight = rng.uniform(0.5, 1.5, n).astype("float32")
    return x, y, sample_weight


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_microbatch_gradients_equal_unsplit(case):
    build, devices, balance = CASES[case]
    x, y = data(case, n=6)  # 6 rows in 4 micro-batches: 2, 2, 1, 1
    ref = build()
    ref.compile(optimizer="sgd", loss="mse")
    with tf.GradientTape() as tape:
        ref_loss = ref.compute_loss(x, y, ref(x, training=True))
    ref_grads = tape.gradient(ref_loss, ref.trainable_variables)

    placed = kg.split_model(build(), devices, balance=balance, microbatches=4)
    # One SGD step with learning rate 1 turns the weights' change into the gradient.
    placed.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    before = [v.numpy() for v in placed.trainable_variables]
    logs = placed.train_on_batch(x, y, return_dict=True)

    assert logs["loss"] == pytest.approx(float(ref_loss), rel=1e-5)
    for b, v, r in zip(before, placed.trainable_variables, ref_grads):
        np.testing.assert_allclose(b - v.numpy(), r.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "n,batch_size,microbatches,steps_per_epoch,epochs,source",
    [
        (102, 32, 4, None, 2, "arrays"),  # last batch 6: micro-batches 2, 2, 1, 1
        (100, 28, 8, None, 2, "arrays"),  # every batch uneven: 28 -> 4 x 4 + 4 x 3
        (102, 32, 4, None, 2, "dataset"),  # batch size unknown when traced
        (100, 32, 8, 3, 1, "arrays"),  # last batch 4 < 8, never reached
        (100, 32, 4, 3, 1, "arrays"),  # last batch 4, never reached
    ],
)
def test_fit_matches_unsplit(n, batch_size, microbatches, steps_per_epoch, epochs, source):
    x, y, sample_weight = _rows(n)

    def fit(model):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        if source == "dataset":
            ds = tf.data.Dataset.from_tensor_slices((x, y, sample_weight)).batch(batch_size)
            args = {"x": ds}
        else:
            args = {"x": x, "y": y, "sample_weight": sample_weight, "batch_size": batch_size}
        return model.fit(
            **args, epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0
        )

    ref_history = fit(mlp())
    placed = kg.split_model(mlp(), DEVICES, microbatches=microbatches)
    history = fit(placed)

    ref = ref_history.model
    assert int(placed.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy())
    np.testing.assert_allclose(
        history.history["loss"], ref_history.history["loss"], rtol=1e-5, atol=1e-7
    )
    for w, r in zip(placed.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(w, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "rows,validation_split,steps_per_epoch,epochs",
    [(100, None, None, 1), (100, None, 3, 2), (125, 0.2, None, 1)],
)
def test_short_last_batch_that_fit_reaches_is_refused_before_any_work(
    rows, validation_split, steps_per_epoch, epochs
):
    # 100 training rows in batches of 32: the last has 4 rows, too few for 8 micro-batches.
    # Three steps an epoch reach it in the second epoch (Keras carries its iterator over
    # epochs); 125 rows less a validation split of 0.2 leave the same 100.
    x, y, _ = _rows(rows)
    placed = kg.split_model(mlp(), DEVICES, microbatches=8)
    placed.compile(optimizer="sgd", loss="mse")
    before = placed.get_weights()
    with pytest.raises(
        ValueError, match=r"microbatches=8.*last batch of 4 samples.*drop the last 4"
    ):
        placed.fit(
            x,
            y,
            batch_size=32,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            validation_split=validation_split,
            verbose=0,
        )
    assert int(placed.optimizer.iterations.numpy()) == 0
    for w, b in zip(placed.get_weights(), before):
        np.testing.assert_array_equal(w, b)


def test_short_batch_of_unknown_size_fails_when_reached():
    x, y, _ = _rows(100)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # last batch: 4 rows
    placed = kg.split_model(mlp(), DEVICES, microbatches=8)
    placed.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tf.errors.InvalidArgumentError, match="fewer than 8 samples"):
        placed.fit(ds, shuffle=False, verbose=0)
