"""`data="shard"` on the fused engine: member i trains on rows i, i+N, ... of each batch.

Each member of a fused pack equals the same model trained alone with plain Keras on
`x[i::N]` (batches of `batch_size / N`, in order): weights, training figures and validation
figures (validation takes every batch whole, as for any pack). A batch whose rows do not
split evenly among the members is refused before any step. On JAX and torch a shard pack
fuses by default (the graph engine, which takes uneven batches, needs TensorFlow); on
TensorFlow it fuses where the tuner asks for it (`_fused_shard`), as its programs do.
"""

import keras
import numpy as np
import pytest

import keras_gpushare as kg

N = 3
ATOL = 1e-6
TENSORFLOW = keras.backend.backend() == "tensorflow"
# On TensorFlow a shard pack trains on the graph engine unless the tuner's flag is given.
FUSED = {"_fused_shard": True} if TENSORFLOW else {}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 5)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    weights = rng.uniform(0.5, 1.5, size=(96,)).astype("float32")
    return x, y, weights


def _model(i, width):
    keras.utils.set_random_seed(10 + i)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def _compile(model):
    model.compile(
        optimizer="adam",
        loss="binary_crossentropy",
        metrics=["accuracy", keras.metrics.AUC(name="auc")],
    )


def test_each_member_trains_on_its_own_rows_as_its_own_fit():
    """Members of three widths (one padded fused group)."""
    widths = (4, 6, 3)
    x, y, weights = _data()
    members = [_model(i, w) for i, w in enumerate(widths)]
    initial = [m.get_weights() for m in members]
    pack = kg.ModelPack(members, data="shard", **FUSED)
    assert pack.engine == "fused"
    _compile(pack)
    fit = dict(epochs=3, shuffle=False, verbose=0, validation_data=(x[:30], y[:30]))
    history = pack.fit(x, y, sample_weight=weights, batch_size=8 * N, **fit).history
    for i, width in enumerate(widths):
        twin = _model(i, width)
        twin.set_weights(initial[i])
        _compile(twin)
        own = twin.fit(x[i::N], y[i::N], sample_weight=weights[i::N], batch_size=8, **fit).history
        for got, want in zip(pack.member(i).get_weights(), twin.get_weights()):
            np.testing.assert_allclose(got, want, atol=ATOL)
        for name in ("loss", "accuracy", "auc"):
            np.testing.assert_allclose(history[f"m{i}_{name}"], own[name], atol=ATOL)
            np.testing.assert_allclose(history[f"val_m{i}_{name}"], own[f"val_{name}"], atol=ATOL)


@pytest.mark.parametrize(
    "fit, says",
    [({"batch_size": 25}, "batch_size=25"), ({"batch_size": 30}, "a last batch of 4 rows")],
    ids=["batch", "last batch"],
)
def test_a_batch_that_does_not_split_evenly_is_refused_before_training(fit, says):
    x, y, _ = _data()
    x, y = x[:64], y[:64]
    members = [_model(i, 4) for i in range(N)]
    pack = kg.ModelPack(members, data="shard", **FUSED)
    _compile(pack)
    before = pack.get_weights()
    with pytest.raises(ValueError, match=f"{says} does not split evenly among the {N} members"):
        pack.fit(x, y, epochs=1, verbose=0, **fit)
    for got, want in zip(pack.get_weights(), before):
        np.testing.assert_array_equal(got, want)
