"""Loss functions and metrics that are not registered with Keras's serialization.

Plain `compile` and `fit` take a user's Python loss function and `keras.metrics.Metric`
subclass as they are; registration is asked for only when a saved file is loaded. A pack
does the same: the reference is each member trained alone with plain Keras from the same
weights and compile arguments. Backend-neutral (the fused engine runs on JAX too); the graph
engine runs on TensorFlow only.
"""

import keras
import numpy as np
import pytest
from pack_builders import assert_weights_close, copy_model, mlp

import keras_gpushare as kg
from keras_gpushare import _upstream

TENSORFLOW = keras.backend.backend() == "tensorflow"
ENGINES = [
    "fused",
    pytest.param(
        "graph",
        marks=pytest.mark.skipif(not TENSORFLOW, reason="the graph engine runs on TensorFlow"),
    ),
]
RATES = (0.05, 0.2)


def soft_error(y_true, y_pred):
    """A per-sample loss that no Keras registry knows."""
    return keras.ops.mean(keras.ops.abs(y_true - y_pred) ** 1.5, axis=-1)


def batch_error(y_true, y_pred):
    """A loss that reduces over the batch itself (one value per batch), as users write."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


def scaled_error(scale):
    """Losses of one name, different by the constant they close over."""

    def scaled(y_true, y_pred):
        return scale * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    return scaled


class AbsError(keras.metrics.Metric):
    """A stateful metric that no Keras registry knows."""

    def __init__(self, name="abs_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(keras.ops.abs(y_true - y_pred)))
        self.count.assign_add(keras.ops.cast(keras.ops.size(y_true), "float32"))

    def result(self):
        return self.total / keras.ops.maximum(self.count, 1.0)


class AboveThreshold(AbsError):
    """A metric whose constructor argument `get_config` leaves out."""

    def __init__(self, threshold=0.5, name="above", **kwargs):
        super().__init__(name=name, **kwargs)
        self.threshold = threshold

    def update_state(self, y_true, y_pred, sample_weight=None):
        above = keras.ops.cast(y_pred > self.threshold, "float32")
        self.total.assign_add(keras.ops.sum(above))
        self.count.assign_add(keras.ops.cast(keras.ops.size(y_true), "float32"))


def sgds():
    return [keras.optimizers.SGD(rate) for rate in RATES]


def members_and_twins():
    members = [mlp(8, seed=s) for s in range(len(RATES))]
    return members, [copy_model(m) for m in members]


def make_pack(members, engine):
    pack = kg.ModelPack(members, fuse=engine == "fused")
    assert pack.engine == engine
    return pack


def fit(model, data):
    x, y = data
    return model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history


def assert_trained_alike(pack, history, twins, twin_histories):
    """Each member's weights and logs (`m{i}_<name>`) equal its twin's (`<name>`)."""
    for i, (member, twin, alone) in enumerate(zip(pack.members, twins, twin_histories)):
        assert_weights_close(member, twin)
        assert alone, "the twin logged nothing"
        for name, values in alone.items():
            np.testing.assert_allclose(history[f"m{i}_{name}"], values, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("engine", ENGINES)
def test_members_compiled_with_unregistered_loss_and_metric_train_as_alone(engine, binary_data):
    members, twins = members_and_twins()
    for model, optimizer in zip(members, sgds()):
        model.compile(optimizer=optimizer, loss=soft_error, metrics=[AbsError()])
    pack = make_pack(members, engine)
    pack.compile()
    history = fit(pack, binary_data)
    for model, optimizer in zip(twins, sgds()):
        model.compile(optimizer=optimizer, loss=soft_error, metrics=[AbsError()])
    assert_trained_alike(pack, history, twins, [fit(t, binary_data) for t in twins])
    assert {"m0_abs_error", "m1_abs_error"} <= set(history)


@pytest.mark.parametrize("engine", ENGINES)
def test_pack_compile_names_another_loss_than_the_members_unregistered_one(engine, binary_data):
    members, twins = members_and_twins()
    for model in members + twins:
        model.compile(optimizer="sgd", loss=soft_error, metrics=[AbsError()])
    pack = make_pack(members, engine)
    pack.compile(optimizer=sgds(), loss="mse")
    history = fit(pack, binary_data)
    # Keras keeps a model's metrics when it is compiled again without `metrics`.
    for model, optimizer in zip(twins, sgds()):
        model.compile(optimizer=optimizer, loss="mse")
    assert_trained_alike(pack, history, twins, [fit(t, binary_data) for t in twins])


@pytest.mark.parametrize("engine", ENGINES)
def test_pack_compile_with_unregistered_loss_and_one_metric_object(engine, binary_data):
    members, twins = members_and_twins()
    pack = make_pack(members, engine)
    metric = AbsError()
    pack.compile(optimizer=sgds(), loss=soft_error, metrics=[metric])
    history = fit(pack, binary_data)
    for model, optimizer in zip(twins, sgds()):
        model.compile(optimizer=optimizer, loss=soft_error, metrics=[AbsError()])
    assert_trained_alike(pack, history, twins, [fit(t, binary_data) for t in twins])
    # Each member counted its own batches in a copy; the object given stayed unused.
    assert float(keras.ops.convert_to_numpy(metric.count)) == 0.0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "losses",
    [[scaled_error(1.0), scaled_error(10.0)], [batch_error, batch_error]],
    ids=["closures_of_one_name", "loss_reducing_the_batch"],
)
def test_unregistered_losses_are_each_members_own(engine, losses, binary_data):
    members, twins = members_and_twins()
    pack = make_pack(members, engine)
    pack.compile(optimizer=sgds(), loss=losses)
    history = fit(pack, binary_data)
    for model, optimizer, loss in zip(twins, sgds(), losses):
        model.compile(optimizer=optimizer, loss=loss)
    assert_trained_alike(pack, history, twins, [fit(t, binary_data) for t in twins])


def test_metric_that_cannot_be_copied_is_refused_when_shared_and_taken_per_member(
    binary_data,
):
    members, twins = members_and_twins()
    pack = kg.ModelPack(members)
    with pytest.raises(ValueError, match=r"differs in \['threshold'\].*one metric object per"):
        pack.compile(optimizer=sgds(), loss="mse", metrics=[AboveThreshold(0.6)])
    pack.compile(
        optimizer=sgds(), loss="mse", metrics=[[AboveThreshold(0.6)], [AboveThreshold(0.6)]]
    )
    history = fit(pack, binary_data)
    for model, optimizer in zip(twins, sgds()):
        model.compile(optimizer=optimizer, loss="mse", metrics=[AboveThreshold(0.6)])
    assert_trained_alike(pack, history, twins, [fit(t, binary_data) for t in twins])


def test_saving_asks_for_registration_as_keras_does(binary_data, tmp_path):
    members, twins = members_and_twins()
    plain = twins[0]
    for model in members + [plain]:
        model.compile(optimizer="sgd", loss=soft_error, metrics=[AbsError()])
    pack = kg.ModelPack(members)
    pack.compile()
    fit(pack, binary_data)
    fit(plain, binary_data)
    custom_objects = {"soft_error": soft_error, "AbsError": AbsError}
    for model, path in ((plain, tmp_path / "plain.keras"), (pack, tmp_path / "pack.keras")):
        model.save(path)
        with pytest.raises(TypeError, match="Could not locate function 'soft_error'"):
            keras.saving.load_model(path)
        loaded = keras.saving.load_model(path, custom_objects=custom_objects)
        assert loaded.compiled


@pytest.mark.parametrize("engine", ENGINES)
def test_member_copy_keeps_unregistered_loss_and_metric(engine, binary_data):
    # `pack.member(i)` raised "Could not locate function 'soft_error'" (Keras's clone_model
    # compiles its clone from the serialized compile settings).
    x, y = binary_data
    members, _ = members_and_twins()
    for model, optimizer in zip(members, sgds()):
        model.compile(optimizer=optimizer, loss=soft_error, metrics=[AbsError()])
    pack = make_pack(members, engine)
    pack.compile()
    fit(pack, binary_data)
    for i in range(len(members)):
        copy = pack.member(i)
        assert copy.loss is soft_error
        expected = pack.members[i].evaluate(x, y, verbose=0, return_dict=True)
        got = copy.evaluate(x, y, verbose=0, return_dict=True)
        assert sorted(got) == sorted(expected) == ["abs_error", "loss"]
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, err_msg=name)
        (metric,) = _upstream.compile_arguments(copy)["metrics"]
        assert isinstance(metric, AbsError)
        assert all(metric is not m for m in _upstream.compile_arguments(members[i])["metrics"])
        assert copy.optimizer is not pack.members[i].optimizer
        np.testing.assert_allclose(
            float(copy.optimizer.learning_rate), RATES[i], rtol=1e-6, err_msg="learning rate"
        )
