"""A placed model computes what the unsplit model computes (torchgpipe's transparency test)."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from placement_models import CASES, data

import keras_gpushare as kg

LOSS = "mse"


def _reference_loss_and_grads(model, x, y):
    model.compile(optimizer="sgd", loss=LOSS)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x, y, y_pred)
    return float(loss), [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_match_unsplit(case, microbatches):
    build, devices, balance = CASES[case]
    x, y = data(case)
    ref_loss, ref_grads = _reference_loss_and_grads(build(), x, y)

    placed = kg.split_model(build(), devices, balance=balance, microbatches=microbatches)
    # One SGD step with learning rate 1 turns the weights' change into the gradient.
    placed.compile(optimizer=keras.optimizers.SGD(1.0), loss=LOSS)
    before = [v.numpy() for v in placed.trainable_variables]
    logs = placed.train_on_batch(x, y, return_dict=True)
    grads = [b - v.numpy() for b, v in zip(before, placed.trainable_variables)]

    assert logs["loss"] == pytest.approx(ref_loss, rel=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "case,microbatches,recompute",
    [("mlp", 1, False), ("mlp", 4, True), ("skip", 4, False), ("multi_io", 4, False)],
)
def test_weights_after_fit_match_unsplit(case, microbatches, recompute):
    build, devices, balance = CASES[case]
    x, y = data(case, n=32)
    ref = build()
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    ref.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)

    placed = kg.split_model(
        build(), devices, balance=balance, microbatches=microbatches, recompute=recompute
    )
    placed.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    placed.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)

    for w, r in zip(placed.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(w, r, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        placed.predict(x, verbose=0)[0] if case == "multi_io" else placed.predict(x, verbose=0),
        ref.predict(x, verbose=0)[0] if case == "multi_io" else ref.predict(x, verbose=0),
        rtol=1e-4,
        atol=1e-5,
    )


def test_stage_builder_matches_unsplit():
    def build(staged):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((6,))
        with kg.stage("/CPU:1") if staged else contextlib.nullcontext():
            h = keras.layers.Dense(8, activation="relu", name="s1")(inputs)
        with kg.stage("/CPU:2") if staged else contextlib.nullcontext():
            outputs = keras.layers.Dense(3, name="s2")(h)
        if staged:
            return kg.PlacedModel(inputs, outputs, microbatches=2)
        return keras.Model(inputs, outputs)

    x, y = data("mlp")
    ref, placed = build(False), build(True)
    assert placed.devices == ["/CPU:1", "/CPU:2"]
    assert placed.plan.layer_names == [["s1"], ["s2"]]
    for m in (ref, placed):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for w, r in zip(placed.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(w, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("recompute", [False, True])
def test_softmax_classifier_matches_unsplit(recompute):
    # Keras computes cross-entropy from the logits behind the softmax output.
    def build():
        keras.utils.set_random_seed(7)
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(4, activation="softmax"),
            ]
        )

    x = np.random.RandomState(0).randn(16, 6).astype("float32")
    y = np.random.RandomState(1).randint(0, 4, 16)
    ref = build()
    placed = kg.split_model(build(), ["/CPU:1", "/CPU:2"], microbatches=2, recompute=recompute)
    for m in (ref, placed):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for w, r in zip(placed.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(w, r, rtol=1e-4, atol=1e-5)
