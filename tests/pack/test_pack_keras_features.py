"""Keras's own fit features and callbacks behave for a pack as they do for one model."""

import csv
import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from pack_builders import assert_weights_close, copy_model, mlp

import keras_gpushare as kg


def compiled_pack(members, **kwargs):
    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"], **kwargs)
    return pack


def test_tf_data_validation_data_and_initial_epoch(binary_data):
    x, y = binary_data
    members = [mlp(6, seed=0), mlp(10, seed=1)]
    twins = [copy_model(m) for m in members]
    train = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(32)
    pack = compiled_pack(members)
    history = pack.fit(
        train, validation_data=(x[256:], y[256:]), epochs=3, initial_epoch=1, verbose=0
    )
    assert history.epoch == [1, 2]
    assert {"val_loss", "val_m0_loss", "val_m1_accuracy"} <= set(history.history)
    for i, twin in enumerate(twins):
        twin.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
        solo = twin.fit(
            train, validation_data=(x[256:], y[256:]), epochs=3, initial_epoch=1, verbose=0
        )
        assert_weights_close(pack.members[i], twin)
        np.testing.assert_allclose(
            history.history[f"val_m{i}_loss"], solo.history["val_loss"], rtol=1e-4
        )


@pytest.mark.parametrize("weighting", ["sample_weight", "class_weight"])
def test_sample_and_class_weights(weighting, binary_data):
    x, y = binary_data
    member = mlp(6)
    twin = copy_model(member)
    if weighting == "sample_weight":
        kwargs = {"sample_weight": np.linspace(0.1, 2.0, len(x)).astype("float32")}
    else:
        kwargs = {"class_weight": {0: 0.3, 1: 3.0}}
    pack = compiled_pack([member])
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, **kwargs)
    twin.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    twin.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, **kwargs)
    assert_weights_close(pack.members[0], twin)


def test_steps_per_execution_does_not_change_results(binary_data):
    x, y = binary_data
    a = [mlp(6, seed=0), mlp(6, seed=1)]
    b = [copy_model(m) for m in a]
    pack_a = compiled_pack(a, steps_per_execution=1)
    pack_b = compiled_pack(b, steps_per_execution=7)
    ha = pack_a.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    hb = pack_b.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for ma, mb in zip(a, b):
        assert_weights_close(ma, mb, atol=1e-6)
    np.testing.assert_allclose(ha.history["loss"], hb.history["loss"], rtol=1e-5)


def test_csv_logger_tensorboard_and_early_stopping(binary_data, tmp_path):
    x, y = binary_data
    pack = compiled_pack([mlp(6, seed=0), mlp(6, seed=1)])
    csv_path = tmp_path / "log.csv"
    callbacks = [
        keras.callbacks.CSVLogger(str(csv_path)),
        keras.callbacks.TensorBoard(log_dir=str(tmp_path / "tb")),
        keras.callbacks.EarlyStopping(monitor="val_m1_loss", patience=0, min_delta=10.0),
    ]
    history = pack.fit(
        x, y, validation_split=0.2, batch_size=32, epochs=5, verbose=0, callbacks=callbacks
    )
    # min_delta=10 never counts as an improvement: EarlyStopping ends fit after epoch 2.
    assert len(history.history["loss"]) == 2
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert {"m0_loss", "m1_accuracy", "val_m1_loss", "loss"} <= set(rows[0])
    events = glob.glob(str(tmp_path / "tb" / "train" / "events.*"))
    assert events
    tags = set()
    for event in tf.compat.v1.train.summary_iterator(events[0]):
        tags |= {v.tag for v in event.summary.value}
    assert {"epoch_m0_loss", "epoch_m1_accuracy", "epoch_loss"} <= tags


def test_model_checkpoint_writes_a_pack_that_reloads(binary_data, tmp_path):
    x, y = binary_data
    pack = compiled_pack([mlp(6, seed=0), mlp(6, seed=1)])
    path = str(tmp_path / "best.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(path, monitor="val_m0_loss", save_best_only=True)
    pack.fit(x, y, validation_split=0.2, epochs=2, verbose=0, callbacks=[checkpoint])
    reloaded = keras.models.load_model(path)
    assert isinstance(reloaded, kg.ModelPack)
    assert len(reloaded.members) == 2


class Interrupt(keras.callbacks.Callback):
    def __init__(self, at_batch):
        super().__init__()
        self.at_batch = at_batch
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at_batch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_after_an_interruption(binary_data, tmp_path):
    x, y = binary_data
    members = [mlp(6, seed=0), mlp(6, seed=1)]
    reference = [copy_model(m) for m in members]
    backup = str(tmp_path / "backup")

    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss="binary_crossentropy", steps_per_execution=1)
    with pytest.raises(RuntimeError, match="interrupted"):
        pack.fit(
            x,
            y,
            batch_size=32,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt(at_batch=15)],
        )
    assert os.listdir(backup)
    # A new process would rebuild the pack from scratch: do the same.
    resumed = kg.ModelPack([copy_model(m) for m in reference])
    resumed.compile(optimizer="adam", loss="binary_crossentropy", steps_per_execution=1)
    history = resumed.fit(
        x,
        y,
        batch_size=32,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    assert history.epoch == [1, 2]

    straight = kg.ModelPack(reference)
    straight.compile(optimizer="adam", loss="binary_crossentropy", steps_per_execution=1)
    straight.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    for a, b in zip(resumed.members, straight.members):
        assert_weights_close(a, b)
