"""Packs and members round-trip through `.keras` files, optimizer state included."""

import keras
import numpy as np
import pytest
from pack_builders import assert_weights_close, copy_model, functional, mlp

import keras_gpushare as kg


def make_pack(members):
    pack = kg.ModelPack(members)
    pack.compile(
        optimizer=[keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1, momentum=0.9)],
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    return pack


def test_save_load_then_continue_equals_not_stopping(binary_data, tmp_path):
    x, y = binary_data
    members = [mlp(6, seed=0), functional(seed=1)]
    twins = [copy_model(m) for m in members]

    pack = make_pack(members)
    pack.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "pack.keras")
    pack.save(path)
    reloaded = keras.models.load_model(path)
    assert isinstance(reloaded, kg.ModelPack)
    assert reloaded.status == pack.status
    for a, b in zip(reloaded.members, pack.members):
        assert_weights_close(a, b, atol=0)
        assert int(a.optimizer.iterations) == int(b.optimizer.iterations)
    reloaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)

    straight = make_pack(twins)
    straight.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(reloaded.members, straight.members):
        assert_weights_close(a, b)


def test_status_survives_saving(binary_data, tmp_path):
    x, y = binary_data
    pack = make_pack([mlp(4, seed=0), mlp(4, seed=1)])
    pack.fit(x, y, epochs=1, verbose=0)
    pack.stop_member(1)
    path = str(tmp_path / "pack.keras")
    pack.save(path)
    assert keras.models.load_model(path).status == ["active", "stopped:early"]


def test_member_copy_is_a_plain_model_with_optimizer_state(binary_data, tmp_path):
    x, y = binary_data
    pack = make_pack([mlp(6, seed=0), mlp(8, seed=1)])
    pack.fit(x, y, batch_size=32, epochs=1, verbose=0)
    copy = pack.member(1)
    assert type(copy) is keras.Sequential
    path = str(tmp_path / "member.keras")
    copy.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), pack.predict(x, verbose=0)[1], rtol=1e-5, atol=1e-6
    )
    assert int(loaded.optimizer.iterations) == int(pack.members[1].optimizer.iterations)
    for a, b in zip(loaded.optimizer.variables, pack.members[1].optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))
    # The copy shares nothing with the pack.
    copy.fit(x, y, epochs=1, verbose=0)
    assert not np.allclose(copy.get_weights()[0], pack.members[1].get_weights()[0])


def test_predict_list_and_stack_and_evaluate(binary_data):
    x, y = binary_data
    pack = make_pack([mlp(6, seed=0), mlp(8, seed=1)])
    outputs = pack.predict(x, verbose=0)
    assert isinstance(outputs, list) and len(outputs) == 2
    for member, out in zip(pack.members, outputs):
        np.testing.assert_allclose(out, member.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    stacked = pack.predict(x, stack=True, verbose=0)
    assert stacked.shape == (2, len(x), 1)
    result = pack.evaluate(x, y, verbose=0, return_dict=True)
    for i, member in enumerate(pack.members):
        member_result = member.evaluate(x, y, verbose=0, return_dict=True)
        assert result[f"m{i}_loss"] == pytest.approx(member_result["loss"], rel=1e-5)
    assert result["loss"] == pytest.approx((result["m0_loss"] + result["m1_loss"]) / 2)


def test_stack_refuses_different_shapes(binary_data):
    x, _ = binary_data
    a = mlp(4)
    b = keras.Sequential([keras.Input((10,)), keras.layers.Dense(3)])
    pack = kg.ModelPack([a, b])
    pack.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="cannot be stacked"):
        pack.predict(x, stack=True, verbose=0)


def test_unbuilt_members_train_save_and_reload(binary_data, tmp_path):
    x, y = binary_data
    members = [
        keras.Sequential([keras.layers.Dense(6, activation="relu"), keras.layers.Dense(1)])
        for _ in range(2)
    ]
    pack = kg.ModelPack(members)
    assert pack.engine == "graph" and "not built" in pack.fusion_report
    pack.compile(optimizer="adam", loss="mse")
    pack.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert all(m.built for m in pack.members)
    path = str(tmp_path / "unbuilt.keras")
    pack.save(path)
    reloaded = keras.models.load_model(path)
    assert reloaded.engine == "graph"
    np.testing.assert_allclose(
        np.stack(reloaded.predict(x, verbose=0)), np.stack(pack.predict(x, verbose=0)), rtol=1e-6
    )
