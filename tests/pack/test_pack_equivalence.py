"""A member trained in a pack ends where the same model trained alone with `fit` ends."""

import keras
import numpy as np
import pytest
from pack_builders import assert_weights_close, copy_model, functional, mlp, subclassed

import keras_gpushare as kg


def make_optimizer(kind, lr):
    if kind == "sgd":
        return keras.optimizers.SGD(learning_rate=lr, momentum=0.9)
    return keras.optimizers.Adam(learning_rate=lr)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_members_match_models_trained_alone(kind, binary_data):
    x, y = binary_data
    members = [mlp(8, seed=0), functional(seed=1), subclassed(seed=2)]
    alone = [copy_model(m) for m in members]
    rates = [0.01, 0.02, 0.005]

    pack = kg.ModelPack(members)
    pack.compile(
        optimizer=[make_optimizer(kind, lr) for lr in rates],
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    history = pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    for i, (model, lr) in enumerate(zip(alone, rates)):
        model.compile(
            optimizer=make_optimizer(kind, lr), loss="binary_crossentropy", metrics=["accuracy"]
        )
        solo = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert_weights_close(pack.members[i], model)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], solo.history["loss"], rtol=1e-4)
        np.testing.assert_allclose(
            history.history[f"m{i}_accuracy"], solo.history["accuracy"], rtol=1e-4
        )
    mean = np.mean([history.history[f"m{i}_loss"] for i in range(3)], axis=0)
    np.testing.assert_allclose(history.history["loss"], mean, rtol=1e-5)


def test_schedule_and_weights_without_xla_match(binary_data):
    x, y = binary_data
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=3, decay_rate=0.5)
    member, twin = mlp(8), None
    twin = copy_model(member)
    pack = kg.ModelPack([member])
    pack.compile(
        optimizer=keras.optimizers.SGD(schedule), loss="binary_crossentropy", jit_compile=False
    )
    pack.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    twin.compile(optimizer=keras.optimizers.SGD(schedule), loss="binary_crossentropy")
    twin.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(pack.members[0], twin, atol=1e-6)


def test_shard_gives_member_i_rows_i_mod_n(binary_data):
    x, y = binary_data
    x, y = x[:100], y[:100]
    members = [mlp(4, seed=s) for s in range(3)]
    alone = [copy_model(m) for m in members]
    pack = kg.ModelPack(members, data="shard")
    pack.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
    # 30 rows a pack step: each member gets 10, and the last step's 10 rows split 4/3/3.
    pack.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0)
    for i, model in enumerate(alone):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
        model.fit(x[i::3], y[i::3], batch_size=10, epochs=2, shuffle=False, verbose=0)
        assert_weights_close(pack.members[i], model)


def test_shard_with_fewer_rows_than_members_in_last_batch(binary_data):
    x, y = binary_data
    x, y = x[:66], y[:66]  # last pack batch has 2 rows for 4 members
    members = [mlp(4, seed=s) for s in range(4)]
    alone = [copy_model(m) for m in members]
    pack = kg.ModelPack(members, data="shard")
    pack.compile(optimizer="adam", loss="binary_crossentropy")
    pack.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert pack.status == ["active"] * 4
    for i, model in enumerate(alone):
        model.compile(optimizer="adam", loss="binary_crossentropy")
        model.fit(x[i::4], y[i::4], batch_size=4, epochs=1, shuffle=False, verbose=0)
        assert_weights_close(pack.members[i], model)


def test_per_member_labels_losses_and_dict_inputs():
    rng = np.random.default_rng(1)
    x = {
        "a": rng.normal(size=(96, 3)).astype("float32"),
        "b": rng.normal(size=(96, 5)).astype("float32"),
    }
    keras.utils.set_random_seed(3)
    ia = keras.Input((3,), name="a")
    reg = keras.Model(ia, keras.layers.Dense(1)(ia))
    ia2, ib = keras.Input((3,), name="a"), keras.Input((5,), name="b")
    h = keras.layers.Concatenate()([ia2, ib])
    cls = keras.Model([ia2, ib], keras.layers.Dense(4, activation="softmax")(h))
    y_reg = x["a"].sum(axis=1, keepdims=True)
    y_cls = rng.integers(0, 4, size=(96,))
    twins = [copy_model(reg), copy_model(cls)]

    pack = kg.ModelPack([reg, cls])
    pack.compile(
        optimizer=[keras.optimizers.SGD(0.05), keras.optimizers.Adam(0.01)],
        loss=["mse", "sparse_categorical_crossentropy"],
        metrics=[["mae"], ["accuracy"]],
    )
    history = pack.fit(x, [y_reg, y_cls], batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert {"m0_mae", "m1_accuracy"} <= set(history.history)

    twins[0].compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    twins[0].fit(x["a"], y_reg, batch_size=16, epochs=2, shuffle=False, verbose=0)
    twins[1].compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    twins[1].fit(
        {"a": x["a"], "b": x["b"]}, y_cls, batch_size=16, epochs=2, shuffle=False, verbose=0
    )
    for member, twin in zip(pack.members, twins):
        assert_weights_close(member, twin)
