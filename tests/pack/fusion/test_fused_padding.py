"""Members of different sizes, depths and activations fuse, each exactly as if trained alone.

Every case packs members that differ (Dense widths, Conv filters, Embedding dimensions, the
number of hidden layers, activations, biases, optimizer families), checks they fuse into one
group, trains the pack and each member alone from the same weights, and compares weights,
histories and a save/load/continue round trip. Backend-neutral (the Makefile reruns
tests/pack/fusion on JAX).
"""

import types

import keras
import numpy as np
import pytest
from keras import layers

import keras_gpushare as kg
from keras_gpushare.pack.fusion import build_fused_model, fusion_report

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 10)).astype("float32")
Y = (X[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")
IMAGES = RNG.normal(size=(64, 8, 8, 2)).astype("float32")
TOKENS = RNG.integers(1, 30, size=(64, 12)).astype("int32")
WIDE = RNG.normal(size=(64, 120)).astype("float32")


def mlp(seed, widths, activation="relu", use_bias=True, dropout=None, norm=None, penalty=None):
    keras.utils.set_random_seed(seed)
    stack = [keras.Input((10,))]
    for width in widths:
        stack.append(
            layers.Dense(
                width,
                activation=activation,
                use_bias=use_bias,
                kernel_regularizer=penalty and keras.regularizers.L2(penalty),
                bias_regularizer=penalty and keras.regularizers.L1(penalty),
            )
        )
        if norm == "batch":
            stack.append(layers.BatchNormalization())
        if norm == "layer":
            stack.append(layers.LayerNormalization())
        if dropout is not None:
            stack.append(layers.Dropout(dropout))
    stack.append(layers.Dense(1, activation="sigmoid"))
    return keras.Sequential(stack)


def wide_mlp(seed, widths, activation):
    """An MLP on 120 features whose wide layers keep padding at zero by masking activations
    (cheaper than masking their kernels at this batch size): sigmoid(0) is not zero."""
    keras.utils.set_random_seed(seed)
    stack = [keras.Input((120,))]
    stack += [layers.Dense(width, activation=activation) for width in widths]
    return keras.Sequential([*stack, layers.Dense(1, activation="sigmoid")])


def cnn(seed, filters, activation="relu"):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 2)),
            layers.Conv2D(filters[0], 3, padding="same", activation=activation),
            layers.BatchNormalization(),
            layers.DepthwiseConv2D(3, padding="same"),
            layers.MaxPooling2D(),
            layers.Conv2D(filters[1], 3, activation="relu"),
            layers.Flatten(),
            layers.Dense(1, activation="sigmoid"),
        ]
    )


def text(seed, dim, units):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((12,), dtype="int32")
    h = layers.Embedding(30, dim)(tokens)
    h = layers.LayerNormalization()(h)
    h = layers.Conv1D(units, 3, activation="tanh")(h)
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, layers.Dense(1, activation="sigmoid")(h))


CASES = {
    "widths": (lambda: [mlp(0, (4,)), mlp(1, (16,)), mlp(2, (9,))], X),
    "activations_and_biases": (
        lambda: [
            mlp(0, (8,), "relu"),
            mlp(1, (8,), "tanh", use_bias=False),
            mlp(2, (12,), "sigmoid"),
        ],
        X,
    ),
    "depths": (
        lambda: [mlp(0, (6,)), mlp(1, (8, 12)), mlp(2, (5, 7, 9)), mlp(3, (16, 4))],
        X,
    ),
    "depths_with_normalization": (
        lambda: [
            mlp(0, (6,), norm="layer"),
            mlp(1, (8, 12), norm="layer"),
            mlp(2, (5, 7, 9), norm="layer", activation="tanh"),
        ],
        X,
    ),
    # The logged losses include each member's own penalty on its own (unpadded) weights.
    "regularizers": (
        lambda: [
            mlp(0, (4,), penalty=0.05),
            mlp(1, (8, 6), penalty=0.05),
            mlp(2, (9,), penalty=0.05),
        ],
        X,
    ),
    "wide_activation_masks": (
        lambda: [
            wide_mlp(0, (200, 150), "sigmoid"),
            wide_mlp(1, (30, 20), "sigmoid"),
            wide_mlp(2, (120,), "tanh"),
        ],
        WIDE,
    ),
    "batch_normalization": (
        lambda: [mlp(0, (6, 4), norm="batch"), mlp(1, (12, 8), norm="batch")],
        X,
    ),
    "convolutions": (lambda: [cnn(0, (4, 3)), cnn(1, (6, 5)), cnn(2, (2, 6))], IMAGES),
    "embeddings": (lambda: [text(0, 4, 3), text(1, 8, 6), text(2, 6, 5)], TOKENS),
}


def _optimizers(case=None):
    if case == "embeddings":
        # On TensorFlow only optimizers linear in the gradient fuse with an Embedding (see
        # test_embedding_members_with_adam_train_on_the_graph_engine_on_tensorflow).
        return [
            keras.optimizers.SGD(0.05),
            keras.optimizers.Lion(0.003),
            keras.optimizers.SGD(0.1, momentum=0.5),
        ]
    return [
        keras.optimizers.Adam(0.01),
        keras.optimizers.SGD(0.05, momentum=0.9),
        keras.optimizers.Adam(0.003),
        keras.optimizers.RMSprop(0.01),
    ]


def _fit(model, x, epochs=2):
    return model.fit(x, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)


def _assert_close(pack_member, twin):
    for a, b in zip(pack_member.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_padded_members_train_as_alone(case, tmp_path):
    build, x = CASES[case]
    members = build()
    twins = build()
    pack = kg.ModelPack(members, fuse=True)
    pack.compile(optimizer=_optimizers(case)[: len(members)], loss="binary_crossentropy")
    assert pack.engine == "fused" and len(pack._gradient_engines) == 1, pack.fusion_report
    history = _fit(pack, x)
    for i, (twin, optimizer) in enumerate(zip(twins, _optimizers(case))):
        twin.compile(optimizer=optimizer, loss="binary_crossentropy")
        alone = _fit(twin, x)
        _assert_close(pack.members[i], twin)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], alone.history["loss"], rtol=1e-4)
    path = tmp_path / "pack.keras"
    pack.save(path)
    loaded = keras.models.load_model(path)
    _fit(loaded, x, epochs=1)
    for i, twin in enumerate(twins):
        _fit(twin, x, epochs=1)
        _assert_close(loaded.members[i], twin)
        _assert_close(loaded.member(i), twin)


def test_padding_stays_zero_and_forward_matches():
    members = [mlp(0, (4,)), mlp(1, (8, 12)), mlp(2, (6,), "tanh", use_bias=False)]
    fused = build_fused_model(members)
    outputs = keras.ops.convert_to_numpy(fused(X))
    for i, member in enumerate(members):
        np.testing.assert_allclose(outputs[i], member(X), rtol=1e-5, atol=1e-6)
    first = fused.graph.layers[1]
    kernel = keras.ops.convert_to_numpy(first.kernel)
    assert kernel.shape == (3, 10, 8)
    assert not kernel[0, :, 4:].any() and not kernel[2, :, 6:].any()


def test_a_shallower_member_lines_up_with_the_first_hidden_layers():
    # Member 0's one hidden layer has the width of member 1's second; it still lines up
    # with member 1's first (both read the model's input), so no layer is padded to the
    # input's width, and the outputs line up with the outputs.
    report = fusion_report([mlp(0, (4,)), mlp(1, (16, 4))])
    dense = [line for line in str(report).splitlines() if "FusedDense" in line]
    assert len(dense) == 3, report
    assert "left out" not in dense[0] and "left out by members 0" in dense[1], report
    assert "left out" not in dense[2], report


def test_report_shows_padding_and_left_out_layers():
    report = fusion_report([mlp(0, (4,)), mlp(1, (8, 12))])
    assert report.fusable
    text = str(report)
    assert "padding" in text and "left out by members 0" in text


def test_a_dense_layer_a_member_leaves_out_is_not_computed_for_it():
    # Members of equal widths that differ only in depth: the shallower member passes its
    # tensor around the extra Dense layer, which, wide enough that its product for that
    # member would cost more than slicing it out, multiplies only the deeper member's
    # input, so the group computes nothing it throws away.
    members = [mlp(0, (256,)), mlp(1, (256, 256))]
    pack = kg.ModelPack(members, fuse=True)
    assert "padding" not in str(pack.fusion_report).splitlines()[1], pack.fusion_report
    fused = build_fused_model(members)
    outputs = keras.ops.convert_to_numpy(fused(X))
    for i, member in enumerate(members):
        np.testing.assert_allclose(outputs[i], member(X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("present", [[1, 2], [0, 2], [0, 1, 3]])
def test_a_layer_some_members_leave_out_multiplies_only_theirs(present):
    # In one run of members (as the planner orders nested depths) the product is padded
    # with zeros; otherwise the members' products are gathered into place.
    from keras_gpushare.pack.fusion.layers_core import FusedDense

    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 5, 6)).astype("float32")
    kernel = rng.normal(size=(4, 6, 3)).astype("float32")
    layer = types.SimpleNamespace(present=present, n_members=4)
    y = FusedDense._present_only_matmul(layer, keras.ops.array(x), keras.ops.array(kernel))
    expected = np.zeros((4, 5, 3), "float32")
    for i in present:
        expected[i] = x[i] @ kernel[i]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(y), expected, rtol=1e-5, atol=1e-6)


def test_the_planner_keeps_very_different_members_apart():
    # A tiny member and a huge one: padding the tiny one to the huge one's widths costs
    # more than running two programs.
    tiny, huge = mlp(0, (2, 2)), mlp(1, (512, 512))
    pack = kg.ModelPack([tiny, mlp(2, (3, 3)), huge], fuse=True)
    assert [sorted(e.member_ids) for e in pack._gradient_engines] == [[0, 1], [2]]
    assert "padding" in pack.fusion_report


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's sparse updates")
def test_embedding_members_with_adam_train_on_the_graph_engine_on_tensorflow():
    members = [text(0, 4, 3), text(1, 4, 3)]
    twins = [text(0, 4, 3), text(1, 4, 3)]
    pack = kg.ModelPack(members)
    with pytest.warns(UserWarning, match="sparse gradient"):
        pack.compile(
            optimizer=[keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02)], loss="mse"
        )
    assert pack.engine == "graph"
    _fit(pack, TOKENS)
    for twin, rate in zip(twins, (0.01, 0.02)):
        twin.compile(optimizer=keras.optimizers.Adam(rate), loss="mse")
        _fit(twin, TOKENS)
    for member, twin in zip(pack.members, twins):
        _assert_close(member, twin)


def test_activations_across_features_do_not_pad():
    def softmax_member(seed, width):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [keras.Input((10,)), layers.Dense(width, activation="softmax"), layers.Dense(1)]
        )

    report = fusion_report([softmax_member(0, 4), softmax_member(1, 8)])
    assert not report.fusable
    assert "activation 'softmax' acts across features" in str(report)
    assert fusion_report([softmax_member(0, 4), softmax_member(1, 4)]).fusable


def test_members_of_different_depths_with_their_own_layer_names_fuse():
    def named(seed, depth):
        keras.utils.set_random_seed(seed)
        stack = [keras.Input((10,))]
        stack += [layers.Dense(8, activation="relu", name=f"dense_{j}") for j in range(depth)]
        return keras.Sequential([*stack, layers.Dense(1, activation="sigmoid", name="out")])

    members, twins = [named(s, s + 1) for s in range(3)], [named(s, s + 1) for s in range(3)]
    pack = kg.ModelPack(members, fuse=True)
    pack.compile(optimizer="adam", loss="binary_crossentropy")
    _fit(pack, X, epochs=1)
    for member, twin in zip(pack.members, twins):
        twin.compile(optimizer="adam", loss="binary_crossentropy")
        _fit(twin, X, epochs=1)
        _assert_close(member, twin)


def test_a_search_over_depth_and_optimizers_stacks_each_layer_in_one_run():
    # A search over `num_layers` and the optimizer family, of layers wide enough that the
    # left-out members' product costs more than slicing it out: the group orders its members
    # so that each layer some members leave out is computed for one run of the others (one
    # slice of its stacked kernel), and each optimizer family is one block.
    depths = [3, 1, 2, 2, 3, 1, 2, 3]
    families = [keras.optimizers.Adam, keras.optimizers.SGD] * 4

    def build():
        members = [mlp(seed, (192,) * depth) for seed, depth in enumerate(depths)]
        for member, family in zip(members, families):
            member.compile(optimizer=family(0.01), loss="binary_crossentropy")
        return members

    members, twins = build(), build()
    pack = kg.ModelPack(members)
    pack.compile(optimizer=[m.optimizer for m in members], loss="binary_crossentropy")
    (engine,) = pack._gradient_engines
    order = list(engine.member_ids)
    assert sorted(order) == list(range(len(depths)))
    names = [type(members[i].optimizer).__name__ for i in order]
    assert names == sorted(names, key=names.index)
    partial = [
        layer.present
        for layer in engine.fused._flatten_layers()
        if getattr(layer, "present", None) is not None and len(layer.present) < len(order)
    ]
    assert len(partial) == 2
    for present in partial:
        assert present == list(range(present[0], present[-1] + 1)), (order, present)
    _fit(pack, X, epochs=1)
    for member, twin in zip(pack.members, twins):
        _fit(twin, X, epochs=1)
        _assert_close(member, twin)


def test_a_cheap_layer_some_members_leave_out_is_computed_for_every_member():
    # Small layers left out by some members: their product costs less than slicing the
    # others' out (`cost.computes_every_member`), so every member's is computed, the members
    # keep their order in the pack (no gather of their state in the step), and each still
    # trains as in its own fit.
    from keras_gpushare.pack.fusion.cost import computes_every_member

    assert computes_every_member(3, 32, 64, 32, overhead=1e7)
    assert not computes_every_member(2, 32, 192, 192, overhead=1e7)
    depths = [3, 1, 2, 2, 3, 1]

    def build():
        members = [mlp(seed, (8,) * depth) for seed, depth in enumerate(depths)]
        for member in members:
            member.compile(optimizer="adam", loss="binary_crossentropy")
        return members

    members, twins = build(), build()
    pack = kg.ModelPack(members)
    pack.compile(loss="binary_crossentropy")
    (engine,) = pack._gradient_engines
    assert list(engine.member_ids) == list(range(len(depths)))
    from keras_gpushare.pack.fusion.layers_core import FusedDense

    partial = [
        layer
        for layer in engine.fused._flatten_layers()
        if isinstance(layer, FusedDense) and len(layer.present) < len(depths)
    ]
    assert partial and not any(layer._present_only(keras.ops.ones((6, 32, 8))) for layer in partial)
    _fit(pack, X, epochs=1)
    for member, twin in zip(pack.members, twins):
        _fit(twin, X, epochs=1)
        _assert_close(member, twin)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the graph engine")
def test_a_member_moved_to_the_graph_engine_leaves_its_group_and_padding():
    members = [mlp(0, (4,)), mlp(1, (16,)), mlp(2, (32,))]
    pack = kg.ModelPack(members)
    assert "padding" in pack.fusion_report
    with pytest.warns(UserWarning, match="graph engine"):
        pack.compile(
            optimizer=[
                keras.optimizers.Adam(),
                keras.optimizers.Adam(),
                keras.optimizers.Adafactor(),
            ],
            loss="binary_crossentropy",
        )
    assert pack.engine == "mixed"
    alone = kg.ModelPack([mlp(0, (4,)), mlp(1, (16,))])
    group_line = next(line for line in alone.fusion_report.splitlines() if "group 0" in line)
    assert group_line in pack.fusion_report
    assert "member 2 on the graph engine: not fused: its optimizer" in pack.fusion_report
