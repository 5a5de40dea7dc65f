"""Inputs or labels that one member cannot take are refused before training, naming it.

Each case also fails in a plain Keras `fit` of that member alone; the pack says which member,
which argument, the shape given and the shape the member accepts, before any step runs.
"""

import re

import keras
import numpy as np
import pytest

import keras_gpushare as kg

ROWS = 8


def dense(inputs, units, seed, activation=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(units, activation=activation)]
    )


def weights(pack):
    return [[w.copy() for w in m.get_weights()] for m in pack.members]


def assert_unchanged(before, pack):
    for old, new in zip(before, weights(pack)):
        for a, b in zip(old, new):
            np.testing.assert_array_equal(a, b)


def assert_plain_keras_fails(member, loss, x, y):
    model = keras.models.clone_model(member)
    model.compile(optimizer="sgd", loss=loss)
    with pytest.raises(Exception):  # noqa: B017, PT011 - Keras's type differs by backend.
        model.fit(x, y, epochs=1, verbose=0)


@pytest.mark.parametrize("widths, x_width, bad", [((4, 6), 4, 1), ((4, 4), 6, 0)])
def test_inputs_a_member_cannot_take(widths, x_width, bad):
    members = [dense(w, 1, seed) for seed, w in enumerate(widths)]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="sgd", loss="mse")
    x = np.ones((ROWS, x_width), "float32")
    y = np.zeros((ROWS, 1), "float32")
    before = weights(pack)
    message = (
        rf"member {bad} .*argument `x` has shape \({ROWS}, {x_width}\).*"
        rf"has shape \(None, {widths[bad]}\)"
    )
    for call in (
        lambda: pack.fit(x, y, epochs=1, verbose=0),
        lambda: pack.evaluate(x, y, verbose=0),
        lambda: pack.predict(x, verbose=0),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    assert_unchanged(before, pack)
    assert_plain_keras_fails(members[bad], "mse", x, y)


def test_dict_input_a_member_cannot_take():
    def member(seed, name, width):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((width,), name=name)
        return keras.Model(inputs, keras.layers.Dense(1)(inputs))

    pack = kg.ModelPack([member(0, "a", 3), member(1, "b", 2)])
    pack.compile(optimizer="sgd", loss="mse")
    x = {"a": np.ones((ROWS, 3), "float32"), "b": np.ones((ROWS, 4), "float32")}
    with pytest.raises(ValueError, match=r"member 1 .*`x\['b'\]` has shape \(8, 4\).*\(None, 2\)"):
        pack.predict(x, verbose=0)


def test_dataset_inputs_a_member_cannot_take():
    tf = pytest.importorskip("tensorflow")
    pack = kg.ModelPack([dense(4, 1, 0), dense(4, 1, 1)])
    pack.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((ROWS, 6), "float32"), np.zeros((ROWS, 1), "float32"))
    ).batch(4)
    before = weights(pack)
    with pytest.raises(ValueError, match=r"member 0 .*`x` has shape \(None, 6\).*\(None, 4\)"):
        pack.fit(data, epochs=1, verbose=0)
    assert_unchanged(before, pack)


def test_labels_that_fit_member_0_but_not_member_1():
    members = [dense(4, 3, 0, "softmax"), dense(4, 5, 1, "softmax")]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="sgd", loss="categorical_crossentropy")
    x = np.ones((ROWS, 4), "float32")
    y = np.eye(3, dtype="float32")[np.arange(ROWS) % 3]
    before = weights(pack)
    message = (
        r"member 1 .*argument `y` has shape \(8, 3\).*`categorical_crossentropy`.*"
        r"output of shape \(None, 5\)"
    )
    with pytest.raises(ValueError, match=message):
        pack.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=message):
        pack.evaluate(x, y, verbose=0)
    assert_unchanged(before, pack)
    assert_plain_keras_fails(members[1], "categorical_crossentropy", x, y)


@pytest.mark.parametrize(
    "bad_labels, message",
    [
        (np.zeros((ROWS - 1, 3), "float32"), r"`y\[1\]` has 7 rows \(shape \(7, 3\)\).*8 samples"),
        (np.zeros((ROWS, 2), "float32"), r"`y\[1\]` has shape \(8, 2\).*shape \(None, 3\)"),
    ],
)
def test_per_member_labels_member_1_cannot_take(bad_labels, message):
    members = [dense(4, 3, 0), dense(4, 3, 1)]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="sgd", loss="mse")
    x = np.ones((ROWS, 4), "float32")
    before = weights(pack)
    with pytest.raises(ValueError, match=rf"member 1 .*{message}"):
        pack.fit(x, [np.zeros((ROWS, 3), "float32"), bad_labels], epochs=1, verbose=0)
    assert_unchanged(before, pack)
    assert_plain_keras_fails(members[1], "mse", x, bad_labels)


@pytest.mark.parametrize(
    "units, loss, labels",
    [
        (3, "mse", np.zeros((ROWS, 1), "float32")),  # broadcast over the outputs
        (1, "binary_crossentropy", np.zeros((ROWS,), "float32")),  # (n,) for (n, 1)
        (3, "sparse_categorical_crossentropy", np.zeros((ROWS,), "int32")),
    ],
)
def test_labels_keras_takes_are_not_refused(units, loss, labels):
    activation = "softmax" if "categorical" in loss else None
    pack = kg.ModelPack([dense(4, units, 0, activation), dense(4, units, 1, activation)])
    pack.compile(optimizer="sgd", loss=loss)
    history = pack.fit(np.ones((ROWS, 4), "float32"), labels, epochs=1, verbose=0)
    assert np.isfinite(history.history["m1_loss"][0])


def test_a_member_index_that_is_no_integer_is_a_type_error_naming_the_argument():
    pack = kg.ModelPack([dense(4, 1, 0), dense(4, 1, 1)])
    for index in ("0", 1.0, True):
        expected = (
            f"Invalid type for argument `index`: got {index!r} of type "
            f"{type(index).__name__}. Expected an integer from 0 to 1"
        )
        for call in (pack.member, pack.get_member_weights, pack.stop_member):
            with pytest.raises(TypeError, match=re.escape(expected)):
                call(index)
    with pytest.raises(ValueError, match=re.escape("this pack has 2 members (0 to 1)")):
        pack.member(5)
    # NumPy integers are integers, as a list index takes them.
    for got, want in zip(pack.member(np.int64(1)).get_weights(), pack.members[1].get_weights()):
        np.testing.assert_array_equal(got, want)
    assert pack.status == ["active", "active"]


def test_python_lists_of_numbers_are_refused_in_one_line_saying_what_was_given():
    pack = kg.ModelPack([dense(4, 1, 0), dense(4, 1, 1)])
    pack.compile(optimizer="sgd", loss="mse")
    x = np.arange(ROWS * 4, dtype="float32").reshape(ROWS, 4)
    y = np.zeros((ROWS, 1), "float32")
    before = weights(pack)
    accepted = (
        "Expected NumPy arrays or tensors (e.g. `np.asarray({0})`), a `tf.data.Dataset`, a "
        "`keras.utils.PyDataset` or a generator (for members with several {1}s, a list or "
        "dict of arrays, one per {1})."
    )
    for call, argument, given in (
        (lambda: pack.fit(x.tolist(), y, epochs=1, verbose=0), "x", f"{ROWS} rows of 4 values"),
        (lambda: pack.evaluate(x.tolist(), y, verbose=0), "x", f"{ROWS} rows of 4 values"),
        (lambda: pack.predict(x[:, 0].tolist(), verbose=0), "x", f"{ROWS} numbers"),
        (lambda: pack.fit(x, y.tolist(), epochs=1, verbose=0), "y", f"{ROWS} rows of 1 value"),
    ):
        with pytest.raises(ValueError) as raised:
            call()
        part = "input" if argument == "x" else "output"
        assert str(raised.value) == (
            f"Invalid value for argument `{argument}`: got a Python list of {given}. "
            + accepted.format(argument, part)
        )
    assert_unchanged(before, pack)
    assert_plain_keras_fails(pack.member_model(0), "mse", x.tolist(), y)
