"""Fused models compute exactly what their members compute, and round-trip."""

import keras
import numpy as np
import pytest
from fusion_models import branches, cnn, gradients, mlp, text
from keras import layers, ops

import keras_gpushare as kg
from keras_gpushare.pack.fusion import FusedLayer, build_fused_model, fusion_report

N = 3
RNG = np.random.default_rng(0)
X_MLP = RNG.normal(size=(5, 10)).astype("float32")
X_CNN = RNG.normal(size=(4, 8, 8, 3)).astype("float32")
X_TEXT = RNG.integers(0, 20, size=(4, 12)).astype("int32")
X_BRANCH = {
    "a": RNG.normal(size=(4, 6)).astype("float32"),
    "b": RNG.normal(size=(4, 4)).astype("float32"),
}
CASES = {"mlp": (mlp, X_MLP), "cnn": (cnn, X_CNN), "text": (text, X_TEXT)}
CASES["branches"] = (branches, X_BRANCH)


def _stack(x, n=N):
    return keras.tree.map_structure(lambda a: np.stack([a] * n), x)


def _close(fused_out, member_outs, atol=2e-5):
    for i, out in enumerate(member_outs):
        keras.tree.map_structure(
            lambda f, m, i=i: np.testing.assert_allclose(
                np.asarray(f)[i], np.asarray(m), atol=atol, rtol=1e-5
            ),
            fused_out,
            out,
        )


@pytest.mark.parametrize("input_mode", ["replicate", "stacked"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_members(case, input_mode):
    build, x = CASES[case]
    members = [build(seed) for seed in range(N)]
    fused = build_fused_model(members, input_mode=input_mode)
    out = fused(x if input_mode == "replicate" else _stack(x))
    _close(out, [m(x) for m in members])
    first = keras.tree.flatten(out)[0]
    assert not np.allclose(np.asarray(first)[0], np.asarray(first)[1])


def test_stacked_inputs_are_per_member():
    members = [mlp(seed) for seed in range(N)]
    fused = build_fused_model(members, input_mode="stacked")
    xs = RNG.normal(size=(N, 5, 10)).astype("float32")
    out = np.asarray(fused(xs))
    for i, member in enumerate(members):
        np.testing.assert_allclose(out[i], np.asarray(member(xs[i])), atol=2e-5)


@pytest.mark.parametrize("case", ["cnn", "branches"])
def test_gradients_match_members(case):
    build, x = CASES[case]
    members = [build(seed) for seed in range(N)]
    fused = build_fused_model(members)
    pairs = fused.member_variable_map(members)
    trainable = [f for f, _ in pairs if f.trainable]

    def fused_loss():
        out = keras.tree.flatten(fused(x, training=True))
        return sum(ops.sum(ops.square(o)) for o in out)

    fused_grads = gradients(fused_loss, trainable)
    for i, member in enumerate(members):
        variables = [m[i][0] for f, m in pairs if f.trainable]

        def member_loss(member=member):
            out = keras.tree.flatten(member(x, training=True))
            return sum(ops.sum(ops.square(o)) for o in out)

        for fused_grad, grad in zip(fused_grads, gradients(member_loss, variables)):
            np.testing.assert_allclose(fused_grad[i], grad, atol=1e-4, rtol=1e-4)


def test_batchnorm_moving_stats_per_member():
    members = [cnn(seed) for seed in range(N)]
    fused = build_fused_model(members)
    fused(X_CNN, training=True)
    for member in members:
        member(X_CNN, training=True)
    copies = [cnn(seed) for seed in range(N)]
    fused.write_to_members(copies)
    for member, copy in zip(members, copies):
        bn, bn_copy = member.layers[1], copy.layers[1]
        for a, b in zip(bn.non_trainable_weights, bn_copy.non_trainable_weights):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    means = [np.asarray(c.layers[1].moving_mean) for c in copies]
    assert not np.allclose(means[0], means[1])
    assert not np.allclose(means[0], 0.0)


def test_dropout_masks_differ_per_member():
    def build(seed):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((64,))
        return keras.Model(inputs, layers.Dropout(0.5, seed=1)(inputs))

    fused = build_fused_model([build(0), build(1)])
    out = np.asarray(fused(np.ones((4, 64), "float32"), training=True))
    assert out.shape == (2, 4, 64)
    assert not np.array_equal(out[0] == 0, out[1] == 0)
    np.testing.assert_array_equal(np.asarray(fused(np.ones((4, 64), "float32"))), 1.0)


def test_write_to_members_round_trip():
    members = [cnn(seed) for seed in range(N)]
    fused = build_fused_model(members)
    for variable in fused.weights:
        variable.assign(RNG.normal(size=variable.shape).astype("float32"))
    copies = [cnn(100 + seed) for seed in range(N)]
    fused.write_to_members(copies)
    _close(fused(X_CNN), [c(X_CNN) for c in copies])
    again = build_fused_model(copies)
    for a, b in zip(fused.weights, again.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_variable_map_pairs_member_variables():
    members = [mlp(seed) for seed in range(N)]
    fused = build_fused_model(members)
    pairs = fused.member_variable_map(members)
    assert len(pairs) == len(members[0].weights) == len(fused.weights)
    for fused_variable, parts in pairs:
        for i, (variable, index) in enumerate(parts):
            assert index is None
            np.testing.assert_array_equal(np.asarray(fused_variable)[i], np.asarray(variable))


def test_save_and_load_round_trip(tmp_path):
    members = [text(seed) for seed in range(N)]
    fused = build_fused_model(members)
    path = str(tmp_path / "fused.keras")
    fused.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.n_members == N and loaded.layer_index == fused.layer_index
    np.testing.assert_allclose(np.asarray(loaded(X_TEXT)), np.asarray(fused(X_TEXT)), atol=1e-6)
    loaded.write_to_members(members)


def test_conv_implementations_agree():
    members = [cnn(seed) for seed in range(2)]
    fused = build_fused_model(members)
    patches = np.asarray(fused(X_CNN))
    for layer in fused.graph.layers:
        if hasattr(layer, "implementation"):
            layer.implementation = "grouped"
    np.testing.assert_allclose(np.asarray(fused(X_CNN)), patches, atol=2e-5)


class Scale(keras.layers.Layer):
    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")

    def call(self, x):
        return x * self.scale


@kg.register_fused_layer(Scale)
class FusedScale(FusedLayer):
    def build(self, input_shape):
        self.scale = self.add_weight(shape=(self.n_members, input_shape[-1]))

    def call(self, inputs, training=None):
        x = self.to_stacked(inputs)
        return x * self.member_broadcast(self.scale, len(x.shape))


def _scaled(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10,))
    return keras.Model(inputs, Scale()(layers.Dense(4)(inputs)))


def test_register_fused_layer_with_custom_layer(tmp_path):
    members = [_scaled(seed) for seed in range(N)]
    report = fusion_report(members)
    assert report.fusable, str(report)
    assert "FusedScale" in str(report)
    fused = build_fused_model(members)
    _close(fused(X_MLP), [m(X_MLP) for m in members])
    path = str(tmp_path / "custom.keras")
    fused.save(path)
    loaded = keras.models.load_model(path, custom_objects={"Scale": Scale})
    np.testing.assert_allclose(np.asarray(loaded(X_MLP)), np.asarray(fused(X_MLP)), atol=1e-6)


def test_register_fused_layer_rejects_non_layers():
    with pytest.raises(TypeError, match="subclass of `keras.layers.Layer`"):
        kg.register_fused_layer(int)
    with pytest.raises(TypeError, match="subclass of `keras_gpushare.pack.fusion.FusedLayer`"):
        kg.register_fused_layer(Scale)(object)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_report_reasons():
    wide = mlp(0, units=(64, 16))
    report = fusion_report([mlp(0), wide])
    assert report.fusable, report
    assert "padding" in str(report)

    relu = keras.Sequential([keras.Input((3,)), layers.Dense(2, activation="relu")])
    tanh = keras.Sequential([keras.Input((3,)), layers.Dense(2, activation="tanh")])
    assert fusion_report([relu, tanh]).fusable
    longer = keras.Sequential([keras.Input((4,)), layers.Dense(2, activation="tanh")])
    assert "member 1 has different inputs" in str(fusion_report([relu, longer]))
    # Regularizer strengths are per-member data (test_fused_regularizers.py); other
    # configuration values must agree.
    penalized = keras.Sequential([keras.Input((3,)), layers.Dense(2, kernel_regularizer="l2")])
    assert fusion_report([relu, penalized]).fusable
    half = layers.Dense(2, activation="relu", dtype="bfloat16")
    half = keras.Sequential([keras.Input((3,)), half])
    assert "config differs in member 1: dtype" in str(fusion_report([relu, half]))

    other_type = keras.Sequential([keras.Input((3, 4)), layers.Flatten(), layers.Dense(2)])
    other = keras.Sequential(
        [keras.Input((3, 4)), layers.GlobalAveragePooling1D(), layers.Dense(2)]
    )
    assert "member 1's layers cannot be lined up with the others'" in str(
        fusion_report([other_type, other])
    )
    # Layers that keep their input's shape may be left out: each member keeps its own.
    relu_then = keras.Sequential([keras.Input((3,)), layers.Dense(2), layers.ReLU()])
    softmax_then = keras.Sequential([keras.Input((3,)), layers.Dense(2), layers.Softmax()])
    assert fusion_report([relu_then, softmax_then]).fusable

    unsupported = keras.Sequential([keras.Input((3, 4, 2)), layers.ConvLSTM1D(2, 2)])
    assert "layer type `ConvLSTM1D` has no fused form" in str(fusion_report([unsupported] * 2))

    masked = keras.Sequential(
        [keras.Input((3,)), layers.Embedding(5, 2, mask_zero=True), layers.BatchNormalization()]
    )
    assert "the fused form `FusedBatchNormalization` does not handle masks" in str(
        fusion_report([masked] * 2)
    )
    tokens = keras.Input((3,))
    by_hand = layers.Lambda(lambda t: keras.ops.not_equal(t, 0))(tokens)
    explicit = layers.GlobalAveragePooling1D()(layers.Embedding(5, 2)(tokens), mask=by_hand)
    explicit = keras.Model(tokens, explicit)
    assert "called with an explicit `mask`" in str(fusion_report([explicit] * 2))

    assert "subclassed model `Subclassed`" in str(fusion_report([Subclassed(), Subclassed()]))
    unbuilt = keras.Sequential([layers.Dense(2)])
    assert "without a known input shape" in str(fusion_report([unbuilt]))

    with pytest.raises(ValueError, match="cannot be fused"):
        build_fused_model([relu, longer])
    with pytest.raises(ValueError, match="Invalid value for argument `input_mode`"):
        build_fused_model([mlp(0)], input_mode="sharded")
