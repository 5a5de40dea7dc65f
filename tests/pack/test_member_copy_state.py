"""`pack.member(i)` carries every layer's state, not only the variables `set_weights` writes.

An adapted `Normalization` keeps its mean and variance as constants made from its variables,
the lookup layers and `TextVectorization` keep their vocabulary in a table (a `.keras` asset),
`Discretization` keeps its bin boundaries in its config. For each, a member trained in a pack,
copied with `pack.member(i)`, predicts and evaluates as the pack's view of it and as its twin
trained alone with plain Keras, and so does the copy saved and reloaded.

No fused form reads such state, so these members train on the graph engine, which runs on
TensorFlow; on other backends the pack refuses them. The fused engine's copies (layers with
their own `load_own_variables`, moving statistics) are checked on every backend.
"""

import keras
import numpy as np
import pytest

import keras_gpushare as kg

TF = keras.backend.backend() == "tensorflow"
graph_engine = pytest.mark.skipif(not TF, reason="the graph engine runs on TensorFlow only")

rng = np.random.default_rng(0)
FLOATS = (rng.normal(size=(192, 6)) * 5 + 3).astype("float32")
INTS = rng.integers(0, 40, size=(192, 6)).astype("int64")
WORDS = np.array(["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen"])
STRINGS = WORDS[rng.integers(0, len(WORDS), size=(192, 3))]
SENTENCES = np.array([" ".join(row) for row in STRINGS])[:, None]
LABELS = {
    "floats": (FLOATS[:, :2].sum(axis=1, keepdims=True) > 6).astype("float32"),
    "ints": (INTS[:, :1] > 20).astype("float32"),
    "strings": np.isin(STRINGS[:, :1], WORDS[:4]).astype("float32"),
}
INPUTS = {"floats": FLOATS, "ints": INTS, "strings": STRINGS, "sentences": SENTENCES}


@keras.saving.register_keras_serializable(package="test_member_copy_state")
class Standardize(keras.layers.Layer):
    """A layer holding an adapted `Normalization` (state two layers down)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.Normalization()

    def build(self, input_shape):
        self.norm.build(input_shape)

    def call(self, x):
        return self.norm(x)


def normalization():
    layer = keras.layers.Normalization()
    layer.adapt(FLOATS)
    return keras.Input((6,)), layer


def inverted_normalization():
    layer = keras.layers.Normalization(invert=True)
    layer.adapt(FLOATS)
    return keras.Input((6,)), layer


def nested_normalization():
    layer = Standardize()
    layer.build((None, 6))
    layer.norm.adapt(FLOATS)
    return keras.Input((6,)), layer


def discretization():
    layer = keras.layers.Discretization(num_bins=4, output_mode="one_hot")
    layer.adapt(FLOATS[:, :1])
    inputs = keras.Input((6,))
    return inputs, lambda x: layer(x[:, :1])


def integer_lookup(output_mode):
    def build():
        layer = keras.layers.IntegerLookup(output_mode=output_mode)
        layer.adapt(INTS)
        return keras.Input((6,), dtype="int64"), layer

    return build


def string_lookup():
    layer = keras.layers.StringLookup(output_mode="multi_hot")
    layer.adapt(STRINGS)
    return keras.Input((3,), dtype="string"), layer


def text_vectorization():
    layer = keras.layers.TextVectorization(output_mode="tf_idf", max_tokens=6)
    layer.adapt(SENTENCES[:, 0])
    return keras.Input((1,), dtype="string"), layer


CASES = {
    "normalization": (normalization, "floats", "floats"),
    "normalization_inverted": (inverted_normalization, "floats", "floats"),
    "normalization_nested": (nested_normalization, "floats", "floats"),
    "discretization": (discretization, "floats", "floats"),
    "integer_lookup": (integer_lookup("multi_hot"), "ints", "ints"),
    "integer_lookup_tf_idf": (integer_lookup("tf_idf"), "ints", "ints"),
    "string_lookup": (string_lookup, "strings", "strings"),
    "text_vectorization": (text_vectorization, "sentences", "strings"),
}
# Plain Keras runs these inside a model on TensorFlow only.
TF_ONLY = {"integer_lookup", "integer_lookup_tf_idf", "string_lookup", "text_vectorization"}


def build(case, seed):
    """A Functional model whose first layer is the case's adapted layer, seeded weights."""
    keras.utils.set_random_seed(seed)
    inputs, layer = CASES[case][0]()
    h = keras.layers.Dense(8, activation="relu")(layer(inputs))
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))


def mlp(seed):
    """A member the fused engine takes: moving statistics, and `Dense` layers (which have
    their own `load_own_variables`)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def compile_and_fit(model, x, y):
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)


def assert_same_model(copy, reference, x, y, tmp_path, atol=1e-5):
    """`copy` predicts and evaluates as `reference`, and so does `copy` saved and reloaded."""
    expected = reference.predict(x, verbose=0)
    np.testing.assert_allclose(copy.predict(x, verbose=0), expected, atol=atol)
    np.testing.assert_allclose(
        copy.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0), rtol=1e-5
    )
    path = str(tmp_path / "member.keras")
    copy.save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), expected, atol=atol)


@graph_engine
@pytest.mark.parametrize("case", CASES)
def test_member_copy_predicts_as_the_member_and_its_twin(case, tmp_path):
    x, y = INPUTS[CASES[case][1]], LABELS[CASES[case][2]]
    if x.dtype.kind == "U":  # Keras's array adapter takes strings as tensors only.
        import tensorflow as tf

        x = tf.constant(x)
    pack = kg.ModelPack([build(case, 0), build(case, 1)])
    pack.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    # No fused form reads an adapted state: the members train on the graph engine.
    assert pack.engine == "graph"
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    twin = build(case, 1)
    compile_and_fit(twin, x, y)

    copy = pack.member(1)
    assert_same_model(copy, pack.members[1], x, y, tmp_path, atol=0)
    assert_same_model(copy, twin, x, y, tmp_path)


@pytest.mark.skipif(TF, reason="TensorFlow trains these members on the graph engine")
@pytest.mark.parametrize("case", sorted(set(CASES) - TF_ONLY))
def test_off_tensorflow_the_pack_refuses_members_with_adapted_layers(case):
    with pytest.raises(ValueError, match="graph engine, which trains members that do not"):
        kg.ModelPack([build(case, 0), build(case, 1)])


def test_fused_member_copy_predicts_as_the_member_and_its_twin(tmp_path):
    x, y = FLOATS, LABELS["floats"]
    pack = kg.ModelPack([mlp(0), mlp(1)])
    pack.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    assert pack.engine == "fused"
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    twin = mlp(1)
    compile_and_fit(twin, x, y)

    copy = pack.member(1)
    assert_same_model(copy, pack.members[1], x, y, tmp_path, atol=0)
    assert_same_model(copy, twin, x, y, tmp_path)


@graph_engine
def test_member_copy_beside_a_fused_group(tmp_path):
    x, y = FLOATS, LABELS["floats"]
    pack = kg.ModelPack([mlp(0), mlp(1), build("normalization", 2)])
    pack.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    assert pack.engine == "mixed"
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    twins = [mlp(1), build("normalization", 2)]
    for twin in twins:
        compile_and_fit(twin, x, y)

    for index, twin in zip((1, 2), twins):
        assert_same_model(pack.member(index), twin, x, y, tmp_path)
