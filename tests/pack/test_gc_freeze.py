"""A pack's first steps trace with the objects alive before them frozen for Python's collector,
and leave the user's collector as it was: unfrozen after the first epoch (and after a `fit`
that raises), untouched when the user froze objects or turned the collector off."""

import gc

import keras
import numpy as np
import pytest
from pack_builders import mlp

import keras_gpushare as kg

X = np.random.default_rng(0).normal(size=(64, 10)).astype("float32")
Y = (X[:, :1] > 0).astype("float32")


class FreezeCounts(keras.callbacks.Callback):
    """The collector's frozen-object count at each epoch's start and at the fit's end."""

    def __init__(self):
        super().__init__()
        self.at_epoch_begin = []
        self.at_train_end = None

    def on_epoch_begin(self, epoch, logs=None):
        self.at_epoch_begin.append(gc.get_freeze_count())

    def on_train_end(self, logs=None):
        self.at_train_end = gc.get_freeze_count()


def pack():
    result = kg.ModelPack([mlp(4, seed=1), mlp(4, seed=2)])
    result.compile(optimizer="sgd", loss="binary_crossentropy")
    return result


@pytest.fixture(autouse=True)
def collector_as_found():
    enabled = gc.isenabled()
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_the_first_epoch_traces_with_old_objects_frozen_then_unfrozen():
    model, counts = pack(), FreezeCounts()
    model.fit(X, Y, epochs=3, batch_size=16, validation_split=0.25, verbose=0, callbacks=[counts])
    assert counts.at_epoch_begin[0] > 0  # the first epoch traces: old objects frozen
    assert counts.at_epoch_begin[1:] == [0, 0]  # released at its end, for the rest of the fit
    assert gc.get_freeze_count() == 0
    # Later calls are traced already: nothing is frozen.
    counts = FreezeCounts()
    model.fit(X, Y, epochs=1, batch_size=16, verbose=0, callbacks=[counts])
    assert counts.at_epoch_begin == [0]


def test_evaluate_and_predict_release_what_they_froze():
    model = pack()
    model.evaluate(X, Y, batch_size=16, verbose=0)
    model.predict(X, batch_size=16, verbose=0)
    assert gc.get_freeze_count() == 0


def test_a_fit_that_raises_leaves_nothing_frozen():
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        pack().fit(X, Y, epochs=2, batch_size=16, verbose=0, callbacks=[Boom()])
    assert gc.get_freeze_count() == 0


def test_the_users_own_freeze_is_left_as_it_was():
    gc.freeze()
    frozen = gc.get_freeze_count()
    counts = FreezeCounts()
    pack().fit(X, Y, epochs=2, batch_size=16, verbose=0, callbacks=[counts])
    # Frozen objects freed meanwhile leave the count; none joined it, none were unfrozen.
    assert 0 < max(counts.at_epoch_begin) <= frozen
    assert 0 < gc.get_freeze_count() <= frozen


def test_a_collector_turned_off_stays_off_and_nothing_is_frozen():
    gc.disable()
    counts = FreezeCounts()
    pack().fit(X, Y, epochs=1, batch_size=16, verbose=0, callbacks=[counts])
    assert counts.at_epoch_begin == [0]
    assert not gc.isenabled()
