"""The graph engine's members are built before the pack's first trace, as their own `fit`s
build them, so the pack's step is traced once.

A plain `fit` on TensorFlow builds the optimizer inside the first trace of its step, and
TensorFlow traces a function that makes variables twice. The pack builds its graph-engine
members' optimizers before its step is traced, in a trace of their own that never runs
(what an optimizer's `build` assigns there is dropped in a plain `fit` too:
`ScheduleFreeAdamW`). The reference is each model trained alone with plain Keras: weights,
optimizer variables and logged losses.
"""

import keras
import numpy as np
import pytest
from unfused_layers import Scale

import keras_gpushare as kg

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the graph engine is TensorFlow's"
)

BATCH = 16
ATOL = 1e-5


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(72, 6)).astype("float32")
    y = x[:, :2].sum(axis=1, keepdims=True).astype("float32")
    return x, y


def _model(seed, family, built=True):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,))] if built else []
    layers += [Scale(), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    model.compile(optimizer=family(learning_rate=1e-2), loss="mse", metrics=["mae"])
    return model


def _fit_counting_traces(model, epochs=3):
    """Fits `model` on `_data()`; returns its history and how often its step was traced."""
    traces = []
    step = model.train_step

    def counted_step(*args):
        traces.append(1)  # Python runs here once per trace
        return step(*args)

    model.train_step = counted_step
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return history.history, len(traces)


# Adafactor makes some of its variables from values computed in `build`, not initializers.
FAMILIES = [
    keras.optimizers.Adam,
    keras.optimizers.SGD,
    keras.optimizers.ScheduleFreeAdamW,
    keras.optimizers.Adafactor,
]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_graph_members_train_as_alone_from_one_trace(family):
    pack = kg.ModelPack([_model(seed, family) for seed in (0, 1)])
    assert pack.engine == "graph", pack.fusion_report
    pack.compile()
    history, traces = _fit_counting_traces(pack)
    assert traces == 1
    for i in (0, 1):
        alone = _model(i, family)
        alone_history, _ = _fit_counting_traces(alone)
        member = pack.member(i)
        for got, want in zip(member.get_weights(), alone.get_weights()):
            np.testing.assert_allclose(got, want, atol=ATOL)
        assert int(member.optimizer.iterations) == int(alone.optimizer.iterations)
        for got, want in zip(member.optimizer.variables, alone.optimizer.variables):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL)
        np.testing.assert_allclose(history[f"m{i}_loss"], alone_history["loss"], atol=ATOL)


def test_members_built_by_their_first_call_still_train_as_alone():
    # Not built before `fit` (no `keras.Input`): they build in the step's trace, as alone.
    pack = kg.ModelPack([_model(seed, keras.optimizers.Adam, built=False) for seed in (0, 1)])
    assert pack.engine == "graph", pack.fusion_report
    pack.compile()
    history, _ = _fit_counting_traces(pack)
    for i in (0, 1):
        alone = _model(i, keras.optimizers.Adam, built=False)
        alone_history, _ = _fit_counting_traces(alone)
        for got, want in zip(pack.member(i).get_weights(), alone.get_weights()):
            np.testing.assert_allclose(got, want, atol=ATOL)
        np.testing.assert_allclose(history[f"m{i}_loss"], alone_history["loss"], atol=ATOL)
