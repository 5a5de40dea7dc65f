"""What plain Keras raises or shows, a pack raises or shows: bad labels, warnings, strategies.

Each test has plain Keras on the same model and data as its reference where Keras has an
answer (the error it raises); messages Keras would show with `warnings.warn` must reach a
user who configured no logging.
"""

import sys

import keras
import numpy as np
import pytest
from conformance_cases import CLASSES, FEATURES, arrays, mlp
from conformance_harness import PACK_ENGINES, TENSORFLOW

import keras_gpushare as kg


def _pack(engine, members, **compile_args):
    pack = kg.ModelPack(members, fuse=False if engine == "graph" else "auto")
    pack.compile(**compile_args)
    return pack


# Item 5: sparse labels out of range ------------------------------------------------------


def _out_of_range():
    data = arrays()
    labels = np.arange(len(data["x"])) % (CLASSES + 2)  # 0..4 for 3 classes
    return data["x"], labels.astype("int32")


def _classifier(i):
    return mlp(i, 6, outputs=CLASSES, activation="softmax")


def _plain_keras_fit(x, y):
    """Member 0 alone: `(error raised, None)` or `(None, history)` where Keras trains."""
    model = _classifier(0)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    try:
        return None, model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    except Exception as e:
        return e, None


@pytest.mark.parametrize(
    "engine",
    [pytest.param("fused", id="fused"), PACK_ENGINES[1]],
)
def test_out_of_range_sparse_labels_raise_as_in_plain_keras(engine):
    x, y = _out_of_range()
    reference, alone = _plain_keras_fit(x, y)
    pack = _pack(
        engine,
        [_classifier(i) for i in range(2)],
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
    )
    if reference is not None:
        with pytest.raises(Exception) as raised:
            pack.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert "label" in str(raised.value).lower() or type(raised.value) is type(reference), (
            f"plain Keras raises {type(reference).__name__}: {reference}; the pack raises "
            f"{type(raised.value).__name__}: {raised.value}"
        )
        return
    # Plain Keras trains on this backend (JAX gathers out-of-range labels without error):
    # the pack trains member 0 as it does.
    history = pack.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    assert pack.status == ["active", "active"], pack.status
    np.testing.assert_allclose(history["m0_loss"], alone["loss"], rtol=1e-5)


# Item 6: messages shown by default -------------------------------------------------------


def _regression_pack(engine, rates):
    data = arrays()
    pack = _pack(
        engine,
        [mlp(i, 6, activation=None) for i in range(len(rates))],
        optimizer=[keras.optimizers.SGD(r) for r in rates],
        loss="mse",
    )
    return pack, data["x"], data["y_reg"] * 1e3


@pytest.mark.parametrize("engine", PACK_ENGINES)
def test_frozen_member_warns_once(engine):
    pack, x, y = _regression_pack(engine, [1e-5, 1e6])
    with pytest.warns(Warning, match="frozen") as caught:
        pack.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert pack.status == ["active", "frozen:nan"]
    assert len([w for w in caught if "frozen" in str(w.message)]) == 1, [
        str(w.message) for w in caught
    ]


class HandMadeSGD(keras.optimizers.Optimizer):
    """A user's own optimizer: no vectorized form, so a fused pack falls back."""

    def update_step(self, gradient, variable, learning_rate):
        variable.assign(variable - learning_rate * gradient)


@pytest.mark.skipif(not TENSORFLOW, reason="the fallback is the graph engine (TensorFlow)")
def test_fallback_to_the_graph_engine_warns():
    pack = kg.ModelPack([mlp(i, 6) for i in range(2)])
    assert pack.engine == "fused"
    with pytest.warns(Warning, match="HandMadeSGD"):
        pack.compile(
            optimizer=[HandMadeSGD(learning_rate=0.01, name=f"hand{i}") for i in range(2)],
            loss="binary_crossentropy",
        )
    assert pack.engine == "graph"


def test_missing_nvml_warns_once(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    data = arrays()
    model = mlp(0, 6)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    with pytest.warns(Warning, match="no GPU figures") as caught:
        model.fit(
            data["x"],
            data["y"],
            epochs=2,
            verbose=0,
            callbacks=[kg.callbacks.UtilizationLogger(interval=0.05, advise=False)],
        )
    assert len([w for w in caught if "no GPU figures" in str(w.message)]) == 1


# Item 2: multi-output labels the pack cannot read ----------------------------------------


def _two_outputs(i):
    keras.utils.set_random_seed(100 + i)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(6, activation="relu")(inputs)
    price = keras.layers.Dense(1, name="price")(h)
    category = keras.layers.Dense(CLASSES, activation="softmax", name="category")(h)
    return keras.Model(inputs, [price, category])


@pytest.mark.parametrize("engine", PACK_ENGINES)
def test_missing_output_labels_raise_a_clear_error(engine):
    """Labels for one of two outputs: plain Keras refuses; the pack names the member."""
    data = arrays()
    pack = _pack(
        engine,
        [_two_outputs(i) for i in range(3)],
        optimizer="adam",
        loss=["mse", "sparse_categorical_crossentropy"],
    )
    with pytest.raises(ValueError, match="member 0"):
        pack.fit(data["x"], {"price": data["y_reg"]}, batch_size=16, epochs=1, verbose=0)
