"""The fused engine: members of one architecture trained as stacked weights.

Backend-neutral: these tests also run with KERAS_BACKEND=jax (see the Makefile). The
reference is each member trained alone with plain `fit` on the same batches; on TensorFlow
the graph engine is compared as well.
"""

import logging

import keras
import numpy as np
import pytest
from pack_builders import assert_weights_close, copy_model, mlp

import keras_gpushare as kg

TENSORFLOW = keras.backend.backend() == "tensorflow"


def cnn(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(6, 2, padding="same"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def text(seed):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((12,), dtype="int32")
    h = keras.layers.Embedding(30, 8)(tokens)
    h = keras.layers.Conv1D(8, 3, activation="relu")(h)
    h = keras.layers.GlobalMaxPooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(1)(h))


def train_alone(models, optimizers, x, y, loss, epochs, batch_size, metrics=None):
    histories = []
    for model, optimizer in zip(models, optimizers):
        model.compile(optimizer=optimizer, loss=loss, metrics=metrics)
        histories.append(
            model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        )
    return histories


def adams(rates):
    return [keras.optimizers.Adam(lr) for lr in rates]


def test_mlp_with_per_member_learning_rates_matches_members_trained_alone(binary_data):
    x, y = binary_data
    rates = (0.001, 0.01, 0.03)
    members = [mlp(8, seed=s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    assert pack.engine == "fused"
    pack.compile(optimizer=adams(rates), loss="binary_crossentropy", metrics=["accuracy"])
    history = pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    alone = train_alone(twins, adams(rates), x, y, "binary_crossentropy", 2, 32, ["accuracy"])
    for i, (member, twin) in enumerate(zip(pack.members, twins)):
        assert_weights_close(member, twin)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], alone[i].history["loss"], 1e-4)
        np.testing.assert_allclose(
            history.history[f"m{i}_accuracy"], alone[i].history["accuracy"], 1e-4
        )


@pytest.mark.skipif(not TENSORFLOW, reason="the graph engine runs on TensorFlow only")
def test_fused_and_graph_engines_end_with_the_same_weights_and_logs(binary_data):
    x, y = binary_data
    rates = (0.002, 0.02)
    members = [mlp(8, seed=s) for s in range(2)]
    twins = [copy_model(m) for m in members]
    fused = kg.ModelPack(members)
    graph = kg.ModelPack(twins, fuse=False)
    assert (fused.engine, graph.engine) == ("fused", "graph")
    for pack in (fused, graph):
        pack.compile(optimizer=adams(rates), loss="binary_crossentropy", metrics=["accuracy"])
    hf = fused.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, validation_split=0.2)
    hg = graph.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, validation_split=0.2)
    assert set(hf.history) == set(hg.history)
    for key in hf.history:
        np.testing.assert_allclose(hf.history[key], hg.history[key], rtol=1e-4, err_msg=key)
    for a, b in zip(fused.members, graph.members):
        assert_weights_close(a, b)


def test_cnn_with_batch_normalization(binary_data):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 3, size=(96,))
    members = [cnn(s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    assert pack.engine == "fused"
    sgd = [keras.optimizers.SGD(lr, momentum=0.9) for lr in (0.01, 0.05, 0.1)]
    pack.compile(optimizer=sgd, loss="sparse_categorical_crossentropy")
    pack.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    sgd = [keras.optimizers.SGD(lr, momentum=0.9) for lr in (0.01, 0.05, 0.1)]
    train_alone(twins, sgd, x, y, "sparse_categorical_crossentropy", 2, 16)
    for member, twin in zip(pack.members, twins):
        # Moving mean and variance of each member's BatchNormalization included.
        assert_weights_close(member, twin, atol=1e-4)


def test_embedding_text_model(binary_data):
    rng = np.random.default_rng(4)
    x = rng.integers(0, 30, size=(128, 12)).astype("int32")
    y = (x[:, :3].sum(axis=1, keepdims=True) / 30.0).astype("float32")
    members = [text(s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    assert pack.engine == "fused"

    # SGD with momentum: on TensorFlow, Keras applies Adam and RMSprop to an Embedding's
    # sparse gradient piece by piece when a token repeats in a batch (squares of the pieces,
    # not the square of their sum); the fused engine, like Keras on JAX, uses the dense
    # gradient. docs/fusion.md says so.
    def sgd():
        return [keras.optimizers.SGD(lr, momentum=0.9) for lr in (0.01, 0.03, 0.1)]

    pack.compile(optimizer=sgd(), loss="mse")
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    train_alone(twins, sgd(), x, y, "mse", 2, 32)
    for member, twin in zip(pack.members, twins):
        assert_weights_close(member, twin, atol=1e-4)


def test_save_load_continue_and_member_reload(binary_data, tmp_path):
    x, y = binary_data
    members = [mlp(8, seed=s) for s in range(3)]
    twins = [copy_model(m) for m in members]

    def make(models):
        pack = kg.ModelPack(models)
        pack.compile(optimizer=adams((0.01, 0.003, 0.02)), loss="binary_crossentropy")
        return pack

    pack = make(members)
    pack.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "fused.keras")
    pack.save(path)
    reloaded = keras.models.load_model(path)
    assert reloaded.engine == "fused"
    reloaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    straight = make(twins)
    straight.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(reloaded.members, straight.members):
        assert_weights_close(a, b)

    member_path = str(tmp_path / "member.keras")
    reloaded.member(2).save(member_path)
    plain = keras.models.load_model(member_path)
    assert type(plain) is keras.Sequential
    np.testing.assert_allclose(
        plain.predict(x, verbose=0), reloaded.predict(x, verbose=0)[2], rtol=1e-5, atol=1e-6
    )
    assert int(plain.optimizer.iterations) == 2 * len(x) // 32


def test_nan_member_is_frozen_and_the_others_match_alone(binary_data, caplog):
    x, y = binary_data
    members = [mlp(8, seed=s, out=None) for s in range(3)]
    twins = [copy_model(members[0]), copy_model(members[2])]
    pack = kg.ModelPack(members)
    pack.compile(
        optimizer=[keras.optimizers.SGD(lr) for lr in (0.01, 1e6, 0.02)],
        loss="mse",
    )
    with caplog.at_level(logging.WARNING, logger="keras_gpushare"):
        history = pack.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert pack.status == ["active", "frozen:nan", "active"]
    assert len([r for r in caplog.records if "member 1" in r.getMessage()]) == 1
    assert all(np.isfinite(w).all() for w in pack.members[1].get_weights())
    assert np.isnan(history.history["m1_loss"][-1])
    train_alone(twins, [keras.optimizers.SGD(0.01), keras.optimizers.SGD(0.02)], x, y, "mse", 3, 32)
    assert_weights_close(pack.members[0], twins[0])
    assert_weights_close(pack.members[2], twins[1])


def test_member_early_stopping_on_the_fused_engine(binary_data):
    x, y = binary_data
    pack = kg.ModelPack([mlp(8, seed=s) for s in range(3)])
    pack.compile(
        optimizer=[keras.optimizers.SGD(lr) for lr in (0.0, 0.1, 0.05)],
        loss="binary_crossentropy",
    )
    snapshots = {}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots[epoch] = [w.copy() for w in pack.get_member_weights(0)]

    stop = kg.callbacks.MemberEarlyStopping(monitor="val_loss", patience=1)
    pack.fit(
        x,
        y,
        validation_split=0.25,
        batch_size=32,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[stop, Record()],
    )
    assert stop.stopped_epoch[0] == 1
    assert pack.status[0] == "stopped:early"
    for a, b in zip(snapshots[1], pack.members[0].get_weights()):
        np.testing.assert_array_equal(a, b)


def test_fuse_true_with_a_member_that_cannot_fuse_names_it():
    from pack_builders import subclassed

    with pytest.raises(ValueError, match="fuse`: True, but member 1: subclassed model"):
        kg.ModelPack([mlp(8, seed=0), subclassed()], fuse=True)
    if TENSORFLOW:
        pack = kg.ModelPack([mlp(8, seed=0), mlp(8, seed=1), subclassed()])
        assert pack.engine == "mixed"
        assert "member 2 on the graph engine: subclassed model" in pack.fusion_report


@pytest.mark.skipif(not TENSORFLOW, reason="the graph engine runs on TensorFlow only")
def test_a_member_alone_on_the_graph_engine_says_why_naming_no_argument_not_passed():
    """`fuse` left at "auto": a member that fuses with no other trains on the graph engine,
    and its reason says so in those terms (not "fuse=True forces ...", never passed)."""
    alone = kg.ModelPack([mlp(8, seed=0)])
    assert alone.engine == "graph"
    assert alone.engine_plan.reasons == {
        0: "it is the pack's only member, and a pack of one trains on the graph engine."
    }
    keras.utils.set_random_seed(2)
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    mixed = kg.ModelPack([mlp(8, seed=0), mlp(8, seed=1), other])
    assert mixed.engine == "mixed"
    assert mixed.engine_plan.reasons == {
        2: "it fuses with no other member, and a member alone trains on the graph engine."
    }
    assert "fuse=" not in alone.fusion_report + mixed.fusion_report


def test_mixed_optimizer_families_train_fused(binary_data):
    x, y = binary_data
    members = [mlp(8, seed=s) for s in range(4)]
    twins = [copy_model(m) for m in members]

    def optimizers():
        return [
            keras.optimizers.Adam(0.01),
            keras.optimizers.SGD(0.1, momentum=0.9),
            keras.optimizers.Adam(0.003),
            keras.optimizers.Nadam(0.01),
        ]

    pack = kg.ModelPack(members)
    pack.compile(optimizer=optimizers(), loss="mse")
    assert pack.engine == "fused"
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    train_alone(twins, optimizers(), x, y, "mse", 2, 32)
    for member, twin in zip(pack.members, twins):
        assert_weights_close(member, twin)


def test_predict_and_evaluate(binary_data):
    x, y = binary_data
    members = [mlp(8, seed=s) for s in range(2)]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss="binary_crossentropy")
    stacked = pack.predict(x, stack=True, verbose=0)
    assert stacked.shape == (2, len(x), 1)
    for i, member in enumerate(members):
        np.testing.assert_allclose(stacked[i], member.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    result = pack.evaluate(x, y, verbose=0, return_dict=True)
    for i, member in enumerate(pack.members):
        member.compile(loss="binary_crossentropy")
        expected = member.evaluate(x, y, verbose=0, return_dict=True)["loss"]
        assert result[f"m{i}_loss"] == pytest.approx(expected, rel=1e-5)


def test_a_stopped_member_keeps_its_batch_normalization_statistics(binary_data):
    x, y = binary_data

    def build(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((10,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )

    members = [build(0), build(1)]
    twin = copy_model(members[0])

    class StopMemberZero(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                self.model.stop_member(0)

    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss="binary_crossentropy")
    assert pack.engine == "fused"
    pack.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[StopMemberZero()])
    twin.compile(optimizer="adam", loss="binary_crossentropy")
    twin.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    # The moving mean and variance too: the member's own fit would have ended.
    assert_weights_close(pack.members[0], twin)
