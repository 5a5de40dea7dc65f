"""A diverging member is frozen; the others train exactly as they would have without it."""

import logging

import keras
import numpy as np
from pack_builders import assert_weights_close, copy_model, mlp

import keras_gpushare as kg


def test_nan_member_is_frozen_and_others_unaffected(binary_data, caplog):
    x, y = binary_data
    members = [mlp(8, seed=0), mlp(8, seed=1, out=None), mlp(8, seed=2)]
    twins = [copy_model(members[0]), copy_model(members[2])]
    pack = kg.ModelPack(members)
    pack.compile(
        optimizer=[
            keras.optimizers.SGD(0.05),
            keras.optimizers.SGD(1e6),
            keras.optimizers.Adam(0.01),
        ],
        loss="mse",
    )
    weights_seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            weights_seen.append([w.copy() for w in pack.members[1].get_weights()])

    with caplog.at_level(logging.WARNING, logger="keras_gpushare"):
        history = pack.fit(
            x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[Record()]
        )

    assert pack.status == ["active", "frozen:nan", "active"]
    frozen_messages = [r for r in caplog.records if "member 1" in r.getMessage()]
    assert len(frozen_messages) == 1
    for w in pack.members[1].get_weights():
        assert np.all(np.isfinite(w))
    # Frozen weights do not move after the freeze.
    for a, b in zip(weights_seen[1], weights_seen[2]):
        np.testing.assert_array_equal(a, b)
    assert np.isnan(history.history["m1_loss"][-1])
    assert np.isfinite(history.history["loss"]).all()

    twins[0].compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    twins[1].compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    for twin in twins:
        twin.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert_weights_close(pack.members[0], twins[0])
    assert_weights_close(pack.members[2], twins[1])


def test_fit_ends_when_every_member_is_frozen(binary_data):
    x, y = binary_data
    pack = kg.ModelPack([mlp(4, seed=0, out=None), mlp(4, seed=1, out=None)])
    pack.compile(optimizer=keras.optimizers.SGD(1e8), loss="mse")
    history = pack.fit(x, y, batch_size=32, epochs=5, verbose=0)
    assert pack.status == ["frozen:nan", "frozen:nan"]
    assert len(history.history["loss"]) < 5


def test_member_early_stopping_stops_members_one_by_one(binary_data):
    x, y = binary_data
    pack = kg.ModelPack([mlp(8, seed=s) for s in range(3)])
    pack.compile(
        optimizer=[keras.optimizers.SGD(lr) for lr in (0.0, 0.5, 0.05)],
        loss="binary_crossentropy",
    )
    stop = kg.callbacks.MemberEarlyStopping(monitor="val_loss", patience=1)
    frozen_weights = {}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            for i, state in enumerate(pack.status):
                if state == "stopped:early" and i not in frozen_weights:
                    frozen_weights[i] = [w.copy() for w in pack.members[i].get_weights()]

    history = pack.fit(
        x,
        y,
        validation_split=0.25,
        batch_size=32,
        epochs=40,
        shuffle=False,
        verbose=0,
        callbacks=[stop, Record()],
    )
    # Member 0 never learns (learning rate 0): it stops after patience + 1 epochs.
    assert stop.stopped_epoch[0] == 1
    assert pack.status[0] == "stopped:early"
    assert "stopped:early" in pack.status
    # A stopped member's weights never change afterwards.
    for i, weights in frozen_weights.items():
        for a, b in zip(weights, pack.members[i].get_weights()):
            np.testing.assert_array_equal(a, b)
    if all(s == "stopped:early" for s in pack.status):
        assert len(history.history["loss"]) < 40


def test_member_early_stopping_restores_best_weights(binary_data):
    x, y = binary_data
    pack = kg.ModelPack([mlp(8, seed=0), mlp(8, seed=1)])
    pack.compile(optimizer=[keras.optimizers.SGD(3.0), keras.optimizers.SGD(0.01)], loss="mse")
    best = {}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            value = logs["val_m0_loss"]
            if "loss" not in best or value < best["loss"]:
                best["loss"] = value
                best["weights"] = [w.copy() for w in pack.members[0].get_weights()]

    stop = kg.callbacks.MemberEarlyStopping(
        monitor="val_loss", patience=2, restore_best_weights=True
    )
    pack.fit(
        x,
        y,
        validation_split=0.25,
        batch_size=8,
        epochs=6,
        shuffle=False,
        verbose=0,
        callbacks=[Record(), stop],
    )
    for a, b in zip(best["weights"], pack.members[0].get_weights()):
        np.testing.assert_allclose(a, b)


def test_member_early_stopping_needs_a_pack(binary_data):
    x, y = binary_data
    model = mlp(4)
    model.compile(optimizer="sgd", loss="mse")
    import pytest

    with pytest.raises(TypeError, match="MemberEarlyStopping works on a ModelPack"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[kg.callbacks.MemberEarlyStopping()])


def test_on_nan_ignore_trains_a_diverging_member_as_plain_fit_does(binary_data):
    # Backend-neutral: the fused engine applies the non-finite step, as Keras does, and the
    # member's logged loss turns NaN in the epoch it diverges, as in its own fit.
    x, y = binary_data
    y = y * 1000.0
    members = [mlp(8, seed=0, out=None), mlp(8, seed=1, out=None)]
    twins = [copy_model(m) for m in members]

    def optimizers():
        return [keras.optimizers.SGD(1e-6), keras.optimizers.SGD(10.0)]

    pack = kg.ModelPack(members, on_nan="ignore")
    pack.compile(optimizer=optimizers(), loss="mse")
    history = pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert pack.status == ["active", "active"]
    for i, (twin, optimizer) in enumerate(zip(twins, optimizers())):
        twin.compile(optimizer=optimizer, loss="mse")
        alone = twin.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], alone.history["loss"], rtol=1e-5)
        for a, b in zip(pack.members[i].get_weights(), twin.get_weights()):
            # Past an overflow, inf and NaN follow the order of floating-point operations:
            # the diverged weights are not finite where the twin's are not.
            np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
            np.testing.assert_allclose(a[np.isfinite(a)], b[np.isfinite(b)], rtol=1e-5, atol=1e-6)
    assert np.isnan(history.history["m1_loss"]).all()
