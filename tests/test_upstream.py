"""Every private Keras / KerasTuner / TensorFlow name in keras_gpushare/_upstream.py, checked
against the installed releases: one test per accessor, on real objects, with a known answer.

When a release renames, removes or changes one of these names, the test of its accessor fails
and names it. `test_every_accessor_has_a_test` keeps the list complete.
"""

import inspect
import os

import keras
import numpy as np
import pytest
from keras import tree

from keras_gpushare import _upstream

TF = keras.backend.backend() == "tensorflow"
needs_tf = pytest.mark.skipif(not TF, reason="a TensorFlow-backend name")
TESTED = set()


def covers(*names):
    def mark(fn):
        TESTED.update(names)
        return fn

    return mark


def functional():
    inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((2,), name="b")}
    h = keras.layers.Dense(4, activation="relu", name="hidden")(inputs["a"])
    h = keras.layers.Concatenate(name="join")([h, inputs["b"]])
    out = keras.layers.Dense(2, activation="softmax", name="probs")(h)
    return keras.Model(inputs, [out], name="net")


def compiled_sequential(**compile_kwargs):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="d"), keras.layers.Dropout(0.1)]
    )
    model.compile(optimizer="sgd", loss="mse", **({"metrics": ["mae"]} | compile_kwargs))
    return model


def built(optimizer, n=2):
    variables = [keras.Variable(np.ones((2,), "float32") * i, name=f"v{i}") for i in range(n)]
    optimizer.build(variables)
    return optimizer, variables


# ---------------------------------------------------------------- Keras: layer graphs


@covers("has_layer_graph", "nodes_by_depth")
def test_nodes_by_depth_lists_a_functional_graph_from_outputs_down():
    model = functional()
    assert _upstream.has_layer_graph(model)
    assert not _upstream.has_layer_graph(keras.layers.Dense(1))
    by_depth = _upstream.nodes_by_depth(model)
    order = [
        node.operation.name
        for depth in sorted(by_depth, reverse=True)
        for node in by_depth[depth]
        if not node.is_input
    ]
    assert order == ["hidden", "join", "probs"]
    assert all(hasattr(n, "arguments") and hasattr(n, "outputs") for n in by_depth[0])


@covers("sequential_graph")
def test_sequential_graph_is_the_functional_model_inside():
    model = compiled_sequential()
    inner = _upstream.sequential_graph(model)
    assert isinstance(inner, keras.Model) and _upstream.has_layer_graph(inner)
    assert [type(layer).__name__ for layer in inner.layers] == ["InputLayer", "Dense", "Dropout"]
    assert _upstream.sequential_graph(keras.Sequential([keras.layers.Dense(1)])) is None


@covers("inputs_struct", "outputs_struct", "standardize_inputs")
def test_input_and_output_structures():
    model = functional()
    struct = _upstream.inputs_struct(model)
    assert isinstance(struct, dict) and sorted(struct) == ["a", "b"]
    assert isinstance(_upstream.outputs_struct(model), list)
    flat = _upstream.standardize_inputs(
        model, {"b": np.zeros((1, 2), "float32"), "a": np.ones((1, 3), "float32")}
    )
    assert [tuple(t.shape) for t in flat] == [(1, 3), (1, 2)]  # in the inputs' order

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert _upstream.inputs_struct(Subclassed()) is None


@covers("producing_layer", "logits_of")
def test_symbolic_tensor_history_and_logits():
    model = functional()
    out = model.outputs[0]
    assert _upstream.producing_layer(out).name == "probs"
    assert _upstream.logits_of(keras.ops.ones((1, 2))) is None
    if not TF:
        return  # placement, the only user, is TensorFlow's
    import tensorflow as tf

    # Keras keeps the pre-softmax tensor on a softmax layer's output (in a graph) for
    # cross-entropy; placement runs layer by layer and watches it.
    layer = keras.layers.Dense(2, activation="softmax")

    @tf.function
    def softmax_of_logits_minus_probs(x):
        y = layer(x)
        return tf.nn.softmax(_upstream.logits_of(y)) - y

    difference = softmax_of_logits_minus_probs(tf.ones((1, 3)))
    np.testing.assert_allclose(difference.numpy(), 0.0, atol=1e-6)


@covers("call_context_args")
def test_layers_take_training_as_a_call_context_argument():
    inputs = keras.Input((3,))
    x = keras.layers.Dropout(0.5)(inputs)
    x = keras.ops.add(x, x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    operations = [
        node.operation
        for nodes in _upstream.nodes_by_depth(model).values()
        for node in nodes
        if not node.is_input
    ]
    by_type = {type(op).__name__: _upstream.call_context_args(op) for op in operations}
    assert "training" in by_type["Dropout"] and "training" in by_type["Dense"]
    assert by_type["Add"] == frozenset()  # a keras.ops operation, not a layer
    # Before Keras 3.10 layers had no `_call_context_args`; every layer took `training`.
    old_style = keras.layers.Dense(1)
    if hasattr(old_style, "_call_context_args"):
        object.__delattr__(old_style, "_call_context_args")
    assert _upstream.call_context_args(old_style) == frozenset({"training"})


@covers("call_takes_training", "call_takes_mask")
def test_call_takes_training_and_mask_follow_the_call_signature():
    class Plain(keras.layers.Layer):
        def call(self, x):
            return x

    assert _upstream.call_takes_training(keras.layers.Dropout(0.5))
    assert not _upstream.call_takes_mask(keras.layers.Dropout(0.5))
    assert _upstream.call_takes_mask(keras.layers.LSTM(2))
    assert not _upstream.call_takes_training(Plain())
    assert not _upstream.call_takes_training(object())  # not a layer
    assert not _upstream.call_takes_mask(object())


@covers("name_scope_path")
def test_name_scope_path_of_a_layer_first_called_in_a_scope():
    layer = keras.layers.Dense(1)
    assert _upstream.name_scope_path(layer) == ""
    with keras.name_scope("outer"), keras.name_scope("inner"):
        layer(keras.Input((2,)))
    assert _upstream.name_scope_path(layer).split("/")[-2:] == ["outer", "inner"]


@covers("untrack_layer")
def test_untrack_layer_removes_it_from_the_model_layers():
    class Holder(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(1)
            self.b = keras.layers.Dense(1)

        def call(self, x):
            return self.a(x)

    model = Holder()
    _upstream.untrack_layer(model, model.b)
    assert model.layers == [model.a]


@covers("all_layers")
def test_all_layers_walks_nested_layers_once_in_weights_order():
    inner = keras.layers.TextVectorization()
    shared = keras.layers.Dense(2, name="shared")
    inputs = keras.Input((3,))
    sub = keras.Sequential([keras.Input((2,)), shared, keras.layers.Dense(1)], name="sub")
    model = keras.Model(inputs, sub(shared(keras.layers.Dense(2)(inputs))))
    layers = _upstream.all_layers(model)
    assert layers[0] is model and sub in layers and shared in layers
    assert len({id(layer) for layer in layers}) == len(layers)
    dense = [v for layer in layers if isinstance(layer, keras.layers.Dense) for v in layer.weights]
    assert [id(v) for v in dense] == [id(v) for v in model.weights]
    lookups = [x for x in _upstream.all_layers(inner) if isinstance(x, keras.layers.StringLookup)]
    assert len(lookups) == 1


@covers("model_strategy")
def test_model_strategy_is_none_without_one():
    assert _upstream.model_strategy(functional()) is None
    if TF:
        import tensorflow as tf

        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            model = functional()
        assert _upstream.model_strategy(model) is strategy


@covers("symbolic_build", "compile_loss", "compile_metrics")
def test_compiled_loss_and_metrics_after_a_symbolic_build():
    model = compiled_sequential(weighted_metrics=["mse"])
    assert not _upstream.compile_metrics(model).built
    batch = (np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"))
    _upstream.symbolic_build(model, batch)
    metrics = _upstream.compile_metrics(model)
    assert metrics.built
    per_output = _upstream.metric_parts(metrics, weighted=True)
    assert len(per_output) == 1  # one output
    assert [m.name for m in per_output[0][1]] == ["mse"]
    assert [m.name for m in _upstream.metric_parts(metrics)[0][1]] == ["mae"]
    y_pred = np.full((4, 2), 2.0, "float32")
    loss = _upstream.compile_loss(model)(batch[1], y_pred, None)
    assert float(keras.ops.convert_to_numpy(loss)) == pytest.approx(4.0)
    assert _upstream.compile_loss(keras.Sequential()) is None


@covers("loss_parts", "metric_parts", "flat_outputs")
def test_the_parts_of_a_two_output_models_compiled_loss_and_metrics():
    inputs = keras.Input((3,))
    a = keras.layers.Dense(1, name="a")(inputs)
    b = keras.layers.Dense(2, name="b")(inputs)
    model = keras.Model(inputs, [a, b])
    model.compile(
        loss={"a": "mse", "b": "mae"}, loss_weights={"a": 1.0, "b": 0.5}, metrics={"b": ["mse"]}
    )
    x = np.ones((4, 3), "float32")
    y = {"a": np.zeros((4, 1), "float32"), "b": np.ones((4, 2), "float32")}
    _upstream.symbolic_build(model, (x, y))
    parts = _upstream.loss_parts(_upstream.compile_loss(model))
    assert [(path, weight, tracker.name) for path, _, weight, tracker in parts] == [
        ((0,), 1.0, "a_loss"),
        ((1,), 0.5, "b_loss"),
    ]
    assert [type(fn).__name__ for _, fn, _, _ in parts] == ["LossFunctionWrapper"] * 2
    metrics = _upstream.compile_metrics(model)
    assert [
        None if p is None else (p[0], [m.name for m in p[1]])
        for p in _upstream.metric_parts(metrics)
    ] == [None, ("b", ["mse"])]
    assert _upstream.flat_outputs(metrics, y)[1] is y["b"]


@covers("maybe_symbolic_build")
@needs_tf
def test_maybe_symbolic_build_builds_the_compiled_metrics_also_through_super():
    class Recording(keras.Sequential):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            self.overridden = True
            _upstream.maybe_symbolic_build(super(), data_batch)

    import tensorflow as tf

    def compiled():
        model = Recording([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model

    batch = (np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"))
    model = compiled()
    _upstream.maybe_symbolic_build(model, batch)
    assert model.overridden and not _upstream.compile_metrics(model).built  # Keras defers
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = compiled()
    _upstream.maybe_symbolic_build(model, batch)
    assert model.overridden and _upstream.compile_metrics(model).built


@covers("keep_jax_state")
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="a JAX-backend name")
def test_keep_jax_state_is_written_back_by_jax_state_sync():
    model = compiled_sequential()
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), verbose=0)
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    state = tuple([keras.ops.convert_to_numpy(v) + 1 for v in group] for group in groups)
    _upstream.keep_jax_state(model, state)
    model.jax_state_sync()
    for group, values in zip(groups, state):
        for variable, value in zip(group, values):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)


@covers("loss_tracker", "compute_loss")
def test_loss_tracker_and_compute_loss():
    model = compiled_sequential()
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    tracker = _upstream.loss_tracker(model)
    assert tracker.name == "loss" and int(keras.ops.convert_to_numpy(tracker.count)) > 0
    y_pred = np.ones((4, 2), "float32")
    loss = _upstream.compute_loss(model, x, y, y_pred, None, training=False)
    assert float(keras.ops.convert_to_numpy(loss)) == pytest.approx(1.0)


@covers("epoch_iterator_data")
def test_epoch_iterator_data_is_the_last_item_of_each_entry():
    from keras.src.trainers.epoch_iterator import EpochIterator

    x = np.arange(12, dtype="float32").reshape(6, 2)
    iterator = EpochIterator(x=x, batch_size=2, steps_per_execution=1, shuffle=False)
    seen = []
    for data in _upstream.epoch_iterator_data(iterator):
        batch = next(data) if hasattr(data, "__next__") else data[0]
        seen.append(keras.ops.convert_to_numpy(tree.flatten(batch)[0]))
        if len(seen) == 3:
            break
    np.testing.assert_array_equal(np.concatenate(seen), x)


@covers("fit_epoch_iterator")
def test_fit_epoch_iterator_draws_the_order_fit_draws_under_a_seed():
    x = np.arange(10)

    def order():
        keras.utils.set_random_seed(5)
        iterator = _upstream.fit_epoch_iterator(x, 4, True, 1)
        seen = []
        for data in _upstream.epoch_iterator_data(iterator):
            batch = next(data) if hasattr(data, "__next__") else data[0]
            seen.append(keras.ops.convert_to_numpy(tree.flatten(batch)[0]))
        return np.concatenate(seen)

    first = order()
    assert sorted(first.tolist()) == list(range(10)) and first.tolist() != list(range(10))
    np.testing.assert_array_equal(order(), first)


@covers("train_validation_split")
def test_train_validation_split_keeps_the_last_rows_for_validation():
    x, y = np.arange(10), np.arange(10) * 2
    (x_train, y_train, none), (x_val, y_val, _) = _upstream.train_validation_split(
        (x, y, None), 0.2
    )
    np.testing.assert_array_equal(x_train, x[:8])
    np.testing.assert_array_equal(y_val, y[8:])
    assert none is None


@covers("tf_seed_state", "set_tf_seed_state")
def test_tf_seed_state_round_trips_the_seeds_of_eager_random_ops():
    pytest.importorskip("tensorflow")
    import tensorflow as tf

    tf.random.set_seed(7)
    state = _upstream.tf_seed_state()
    first = tf.random.uniform((3,)).numpy()
    tf.random.set_seed(8)
    _upstream.set_tf_seed_state(state)
    np.testing.assert_array_equal(tf.random.uniform((3,)).numpy(), first)


@covers("keras_global_state", "set_keras_global_state")
def test_keras_global_state_round_trips_layer_names_and_the_global_seed_generator():
    keras.utils.set_random_seed(3)
    keras.layers.Dense(2)
    keras.random.uniform((2,))
    state = _upstream.keras_global_state()
    name = keras.layers.Dense(2).name
    first = keras.ops.convert_to_numpy(keras.random.uniform((2,)))
    _upstream.set_keras_global_state(state)
    keras.layers.Dense(2)
    keras.utils.set_random_seed(4)
    _upstream.set_keras_global_state(state)
    assert keras.layers.Dense(2).name == name
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.random.uniform((2,))), first)


@covers("tf_global_generator", "set_tf_global_generator")
def test_tf_global_generator_is_read_and_replaced():
    pytest.importorskip("tensorflow")
    import tensorflow as tf

    generator = tf.random.get_global_generator()
    assert _upstream.tf_global_generator() is generator
    _upstream.set_tf_global_generator(None)
    assert _upstream.tf_global_generator() is None
    _upstream.set_tf_global_generator(generator)
    assert tf.random.get_global_generator() is generator


@covers("epoch_iterator_element_spec")
def test_epoch_iterator_element_spec_describes_the_batches_of_a_tensorflow_iterator():
    from keras.src.trainers.epoch_iterator import EpochIterator

    x, y = np.ones((5, 3), "float32"), np.zeros((5,), "int32")  # the last batch is short
    plain = EpochIterator(x=x, y=y, batch_size=2, shuffle=False)
    assert _upstream.epoch_iterator_element_spec(plain) is None
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    iterator = TFEpochIterator(
        x=x, y=y, batch_size=2, shuffle=False, distribute_strategy=tf.distribute.get_strategy()
    )
    spec = _upstream.epoch_iterator_element_spec(iterator)
    assert [(tuple(s.shape), s.dtype.name) for s in tree.flatten(spec)] == [
        ((None, 3), "float32"),
        ((None,), "int32"),
    ]


@covers("progbar_in_fit")
def test_progbar_in_fit_is_true_inside_fit_only():
    seen = []

    class Probe(keras.callbacks.ProgbarLogger):
        def on_test_begin(self, logs=None):
            seen.append(_upstream.progbar_in_fit(self))
            super().on_test_begin(logs)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    x, y = np.zeros((4, 2)), np.zeros((4, 1))
    model.evaluate(x, y, verbose=0, callbacks=[Probe()])
    model.fit(x, y, validation_data=(x, y), verbose=0, callbacks=[Probe()])
    assert seen == [False, True]


@covers("print_msg")
def test_print_msg_prints_as_keras_progress_bars_do(capsys):
    _upstream.print_msg("m0 - loss: 0.5")
    assert capsys.readouterr().out == "m0 - loss: 0.5\n"


@covers("model_supports_jit")
def test_model_supports_jit_is_a_boolean():
    assert _upstream.model_supports_jit(functional()) in (True, False)


@covers("loss_function_wrapper", "wrapped_metric_function")
def test_losses_and_metrics_made_of_a_function():
    wrapper = _upstream.loss_function_wrapper()
    assert isinstance(keras.losses.Huber(), wrapper)
    loss = wrapper(keras.losses.mean_squared_error)
    value = loss(np.zeros((2, 1), "float32"), np.full((2, 1), 3.0, "float32"))
    assert float(keras.ops.convert_to_numpy(value)) == pytest.approx(9.0)
    fn, kwargs = _upstream.wrapped_metric_function(keras.metrics.MeanSquaredError())
    assert fn is keras.metrics.mean_squared_error and kwargs == {}
    fn, kwargs = _upstream.wrapped_metric_function(keras.metrics.BinaryAccuracy(threshold=0.3))
    assert fn is keras.metrics.binary_accuracy and kwargs == {"threshold": 0.3}


@covers("metric_built")
def test_metric_built_tells_when_a_lazily_built_metric_made_its_state():
    for metric in (keras.metrics.F1Score(), keras.metrics.R2Score()):
        assert not _upstream.metric_built(metric)
        metric.update_state(np.zeros((2, 3), "float32"), np.zeros((2, 3), "float32"))
        assert _upstream.metric_built(metric)
    assert _upstream.metric_built(keras.metrics.AUC())


@covers("scale_loss_for_distribution", "unscale_loss_for_distribution")
def test_loss_scaling_for_distribution_round_trips():
    value = keras.ops.convert_to_tensor(3.0)
    scaled = _upstream.scale_loss_for_distribution(value)
    back = _upstream.unscale_loss_for_distribution(scaled)
    assert float(keras.ops.convert_to_numpy(back)) == pytest.approx(3.0)


# ---------------------------------------------------------------- Keras: layers


@covers("is_keras_builtin")
def test_is_keras_builtin_tells_keras_classes_from_others():
    assert _upstream.is_keras_builtin(keras.Model)
    assert _upstream.is_keras_builtin(keras.optimizers.Adam, "optimizers")
    assert not _upstream.is_keras_builtin(keras.optimizers.Adam, "backend")
    # A backend's own optimizer class (torch's Adam, TensorFlow's base) lives in "backend".
    assert any(
        _upstream.is_keras_builtin(cls, "backend") for cls in type(keras.optimizers.Adam()).__mro__
    )

    class Own(keras.layers.Dense):
        pass

    assert not _upstream.is_keras_builtin(Own)


@covers("keras_mask")
def test_keras_mask_of_a_masked_symbolic_tensor():
    inputs = keras.Input((4,), dtype="int32")
    embedded = keras.layers.Embedding(10, 3, mask_zero=True)(inputs)
    mask = _upstream.keras_mask(embedded)
    assert isinstance(mask, keras.KerasTensor) and tuple(mask.shape) == (None, 4)
    assert _upstream.keras_mask(inputs) is None


@covers("attention_equations")
def test_attention_equations_match_multi_head_attention():
    dot, combine, scores_rank = _upstream.attention_equations(4, attn_axes=(1,))
    assert isinstance(dot, str) and isinstance(combine, str)
    assert scores_rank == 4  # (batch, heads, query positions, key positions)
    key = np.ones((2, 5, 3, 4), "float32")  # (batch, positions, heads, head size)
    query = np.ones((2, 6, 3, 4), "float32")
    scores = keras.ops.einsum(dot, key, query)
    assert tuple(scores.shape) == (2, 3, 6, 5)
    value = np.ones((2, 5, 3, 4), "float32")
    assert tuple(keras.ops.einsum(combine, scores, value).shape) == (2, 6, 3, 4)


@covers("backend_rnn")
def test_backend_rnn_runs_a_step_over_time():
    def step(x, states):
        total = states[0] + x
        return total, [total]

    inputs = keras.ops.ones((2, 5, 3))  # (batch, time, features)
    last, outputs, states = _upstream.backend_rnn(
        step, inputs, [keras.ops.zeros((2, 3))], unroll=False, input_length=5
    )
    np.testing.assert_allclose(keras.ops.convert_to_numpy(last), np.full((2, 3), 5.0))
    assert tuple(outputs.shape) == (2, 5, 3)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(states[0]), np.full((2, 3), 5.0))


@covers("conv_transpose_padding_args")
def test_conv_transpose_padding_args_per_spatial_axis():
    pads = _upstream.conv_transpose_padding_args(
        input_shape=(None, None, None),
        kernel_shape=(3, 4, None),
        strides=(2,),
        padding="same",
        output_padding=None,
        dilation_rate=(1,),
    )
    assert len(pads) == 1 and len(pads[0]) == 2
    assert all(int(p) >= 0 for p in pads[0])


# ---------------------------------------------------------------- Keras: optimizers


@pytest.mark.parametrize(
    "optimizer, lists",
    [
        (lambda: keras.optimizers.Adam(amsgrad=True), ("momentums", "velocities", "velocity_hats")),
        (lambda: keras.optimizers.AdamW(), ("momentums", "velocities")),
        (
            lambda: keras.optimizers.RMSprop(momentum=0.9, centered=True),
            ("velocities", "momentums", "average_gradients"),
        ),
        (lambda: keras.optimizers.Adagrad(), ("accumulators",)),
        (lambda: keras.optimizers.Nadam(), ("momentums", "velocities")),
        (lambda: keras.optimizers.Adamax(), ("m", "u")),
        (lambda: keras.optimizers.Adadelta(), ("accumulated_grads", "accumulated_delta_vars")),
        (lambda: keras.optimizers.Ftrl(), ("accumulators", "linears")),
        (
            lambda: keras.optimizers.SGD(gradient_accumulation_steps=2),
            ("accumulated_gradients",),
        ),
    ],
    ids=["adam", "adamw", "rmsprop", "adagrad", "nadam", "adamax", "adadelta", "ftrl", "accum"],
)
@covers("slot_list", "variable_index", "optimizer_variables_list")
def test_slot_lists_hold_one_slot_per_variable_in_index_order(optimizer, lists):
    opt, variables = built(optimizer())
    assert _upstream.optimizer_variables_list(opt) == variables
    for name in lists:
        slots = _upstream.slot_list(opt, name)
        assert len(slots) == len(variables), name
        for v in variables:
            slot = slots[_upstream.variable_index(opt, v)]
            assert tuple(slot.shape) == tuple(v.shape)
    with pytest.raises(ValueError, match="Unknown slot list"):
        _upstream.slot_list(opt, "moments")


@covers("nadam_u_product")
def test_nadam_u_product_is_multiplied_once_per_step():
    opt, variables = built(keras.optimizers.Nadam(beta_1=0.9))
    product = _upstream.nadam_u_product(opt)
    assert float(keras.ops.convert_to_numpy(product)) == 1.0
    opt.apply([keras.ops.ones((2,)) for _ in variables], variables)
    u_1 = 0.9 * (1.0 - 0.5 * 0.96)  # Keras's momentum schedule at step 1
    assert float(keras.ops.convert_to_numpy(product)) == pytest.approx(u_1)


@covers("raw_learning_rate", "iterations_variable")
def test_raw_learning_rate_and_iterations():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert _upstream.raw_learning_rate(keras.optimizers.SGD(schedule)) is schedule
    opt, _ = built(keras.optimizers.SGD(0.25))
    assert float(keras.ops.convert_to_numpy(_upstream.raw_learning_rate(opt))) == 0.25
    _upstream.iterations_variable(opt).assign_add(3)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 3


@covers("weight_decay_exclusions", "apply_weight_decay")
def test_weight_decay_exclusions_and_method():
    opt = keras.optimizers.AdamW(learning_rate=0.5, weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    keys, pattern = _upstream.weight_decay_exclusions(opt)
    assert pattern is not None and pattern.search("dense/bias")
    assert keys is not None
    opt, variables = built(opt)
    assert callable(_upstream.apply_weight_decay(opt))
    assert _upstream.APPLY_WEIGHT_DECAY in dir(type(opt))
    before = keras.ops.convert_to_numpy(variables[1]).copy()
    _upstream.apply_weight_decay(opt)(variables)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variables[1]), before * (1 - 0.05))


@needs_tf
@covers("optimizer_strategy", "reinitialize_variable")
def test_optimizer_strategy_and_reinitialized_variables():
    import tensorflow as tf

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        inside = keras.optimizers.SGD()
    assert _upstream.optimizer_strategy(inside) is strategy
    assert _upstream.optimizer_strategy(keras.optimizers.SGD()) is not strategy
    v = keras.Variable(np.ones((2,), "float32"))
    _upstream.reinitialize_variable(v, tf.Variable(np.full((2,), 7.0, "float32")))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), [7.0, 7.0])


# ---------------------------------------------------------------- Keras: callbacks, metrics


@covers("metric_direction")
def test_metric_direction():
    assert _upstream.metric_direction(keras.metrics.R2Score()) == "up"
    assert _upstream.metric_direction(keras.metrics.MeanSquaredError()) == "down"
    assert _upstream.metric_direction(object()) is None


@covers("reset_monitor_op")
def test_reset_monitor_op_follows_mode():
    stop = keras.callbacks.EarlyStopping(monitor="val_thing", mode="max")
    assert _upstream.reset_monitor_op(stop)
    assert stop.monitor_op(2.0, 1.0)  # larger is better under mode="max"
    assert not _upstream.reset_monitor_op(keras.callbacks.History())


@covers("set_callback_model")
def test_set_callback_model_is_the_model_a_callback_reads(tmp_path):
    board = keras.callbacks.TensorBoard(str(tmp_path))
    model = compiled_sequential()
    _upstream.set_callback_model(board, model)
    assert board.model is model
    assert not os.path.exists(tmp_path / "train")  # set_model's writers were not opened


@covers("backup_weights_path")
def test_backup_weights_path_is_inside_the_backup_dir(tmp_path):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    assert os.path.dirname(_upstream.backup_weights_path(backup)) == str(tmp_path)


@covers("log_weights")
@needs_tf
def test_log_weights_writes_the_weight_histograms(tmp_path):
    board = keras.callbacks.TensorBoard(str(tmp_path), histogram_freq=1)
    board.set_model(compiled_sequential())
    _upstream.log_weights(board, 0)
    board.on_train_end()
    assert list((tmp_path / "train").iterdir())  # the event file of the histograms


@covers("tensorboard_profile_batch")
def test_tensorboard_profile_batch_is_zero_without_profiling(tmp_path):
    assert _upstream.tensorboard_profile_batch(keras.callbacks.TensorBoard(str(tmp_path))) == 0
    if keras.backend.backend() == "tensorflow":  # JAX drops a profile batch, torch refuses it
        board = keras.callbacks.TensorBoard(str(tmp_path), profile_batch=(3, 5))
        assert _upstream.tensorboard_profile_batch(board) == 3


@pytest.mark.parametrize("owner, method, arguments, backend", _upstream.OVERRIDDEN_HOOKS)
def test_overridden_hooks_exist_with_their_arguments(owner, method, arguments, backend):
    if backend not in (None, keras.backend.backend()):
        pytest.skip(f"a hook of the {backend} backend")
    module, _, name = owner.rpartition(".")
    cls = getattr(pytest.importorskip(module), name)
    assert hasattr(cls, method), f"{owner}.{method} is gone"
    params = inspect.signature(getattr(cls, method)).parameters
    assert set(arguments) <= set(params), f"{owner}.{method} takes {list(params)}"


# ---------------------------------------------------------------- TensorFlow: tf.distribute


@needs_tf
@covers("in_multi_worker_mode", "strategy_supports_no_merge_call", "maybe_merge_call")
def test_tf_distribute_internals():
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert _upstream.in_multi_worker_mode(strategy) is False
    assert isinstance(_upstream.strategy_supports_no_merge_call(), bool)
    seen = []

    def replica_fn():
        context = tf.distribute.get_replica_context()
        return _upstream.maybe_merge_call(
            lambda s, value: seen.append(type(s).__name__) or value, context.strategy, 5
        )

    assert strategy.run(replica_fn) == 5
    assert seen == ["MirroredStrategy"]


@covers("compile_arguments")
def test_compile_arguments_are_the_objects_compile_was_given():
    def loss(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    metric = keras.metrics.MeanAbsoluteError()
    model = compiled_sequential(metrics=[metric])
    assert _upstream.compile_arguments(model)["metrics"] == [metric]
    model.compile(optimizer="sgd", loss=loss, loss_weights=[2.0])
    arguments = _upstream.compile_arguments(model)
    assert arguments["loss"] is loss and arguments["loss_weights"] == [2.0]
    assert arguments["metrics"] is None
    assert isinstance(arguments["optimizer"], keras.optimizers.SGD)
    assert _upstream.compile_arguments(keras.Sequential()) == {}


@covers("metric_state_pending")
def test_metric_state_pending_tells_the_metrics_that_shape_their_state_from_a_batch():
    pending = [
        keras.metrics.F1Score(),
        keras.metrics.R2Score(),
        keras.metrics.AUC(multi_label=True),
    ]
    assert all(_upstream.metric_state_pending(m) for m in pending)
    made = [keras.metrics.AUC(), keras.metrics.Precision(), keras.metrics.Mean()]
    assert not any(_upstream.metric_state_pending(m) for m in made)
    y = np.asarray([[0.0, 1.0], [1.0, 0.0]], "float32")
    for metric in pending:
        metric.update_state(y, y)
    assert not any(_upstream.metric_state_pending(m) for m in pending)


@covers("trace_symbolically")
def test_trace_symbolically_makes_state_and_changes_none():
    metric = keras.metrics.F1Score()
    spec = keras.KerasTensor((None, 3), "float32")
    _upstream.trace_symbolically(metric.update_state, spec, spec)
    assert [v.shape for v in metric.variables] == [(3,)] * 4
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(metric.result()), np.zeros(3))


@needs_tf
@covers("in_xla_context")
def test_in_xla_context_tells_an_xla_compiled_trace():
    import tensorflow as tf

    seen = []

    def probe(x):
        seen.append(_upstream.in_xla_context())
        return x + 1

    tf.function(probe, jit_compile=True)(tf.constant(1.0))
    tf.function(probe, jit_compile=False)(tf.constant(1.0))
    assert seen == [True, False]


# ---------------------------------------------------------------- KerasTuner


@pytest.fixture
def kt():
    return pytest.importorskip("keras_tuner")


def _tiny_tuner(kt, tmp_path, **kwargs):
    def build(hp):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(hp.Int("u", 1, 2))])
        model.compile(optimizer="sgd", loss="mse")
        return model

    return kt.RandomSearch(
        build,
        objective="loss",
        max_trials=1,
        directory=str(tmp_path),
        project_name="p",
        **kwargs,
    )


@covers("kt_trial_module", "kt_debug")
def test_kt_trial_module_and_debug(kt):
    trial_module = _upstream.kt_trial_module()
    assert trial_module.Trial is kt.engine.trial.Trial
    assert trial_module.TrialStatus.RUNNING == "RUNNING"
    trial = trial_module.Trial(kt.HyperParameters(), status=trial_module.TrialStatus.IDLE)
    assert trial.status == "IDLE"
    assert isinstance(_upstream.kt_debug(), bool)


@covers("metrics_dict", "best_step")
def test_kt_trial_results_to_metrics(kt):
    objective = kt.Objective("val_loss", "min")
    history = keras.callbacks.History()
    history.history = {"val_loss": [3.0, 1.0, 2.0]}
    assert _upstream.metrics_dict({"val_loss": 1.5}, objective) == {"val_loss": 1.5}
    assert _upstream.metrics_dict(0.5, objective) == {"val_loss": 0.5}
    assert _upstream.metrics_dict(history, objective) == {"val_loss": 1.0}
    assert _upstream.best_step(history, objective) == 1
    assert _upstream.best_step({"val_loss": 1.5}, objective) == 0


@covers("kt_load_json", "kt_save_json")
def test_kt_json(kt, tmp_path):
    path = str(tmp_path / "x.json")
    _upstream.kt_save_json(path, {"a": [1, 2]})
    assert _upstream.kt_load_json(path) == {"a": [1, 2]}


@covers("model_size")
def test_kt_model_size(kt):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert int(_upstream.model_size(model)) == 8


@covers("kt_build_hypermodel")
def test_kt_build_hypermodel_builds_a_trial_model(kt, tmp_path):
    tuner = _tiny_tuner(kt, tmp_path)
    hp = kt.HyperParameters()
    model = _upstream.kt_build_hypermodel(tuner, hp)
    assert isinstance(model, keras.Model) and hp.values == {"u": 1}


@covers("validate_trial_results")
def test_kt_validate_trial_results(kt):
    objective = kt.Objective("val_loss", "min")
    _upstream.validate_trial_results({"val_loss": 1.0}, objective, "f()")
    with pytest.raises(TypeError, match="f()"):
        _upstream.validate_trial_results("bad", objective, "f()")


@covers("release_oracle_lock")
def test_kt_release_oracle_lock(kt):
    import threading

    from keras_tuner.src.engine import oracle as kt_oracle

    oracle = kt.oracles.RandomSearchOracle(objective="loss", max_trials=1)
    assert not _upstream.release_oracle_lock(oracle, threading.current_thread().name)
    kt_oracle.LOCKS[oracle].acquire()
    kt_oracle.THREADS[oracle] = threading.current_thread().name
    assert _upstream.release_oracle_lock(oracle, threading.current_thread().name)
    assert kt_oracle.LOCKS[oracle].acquire(blocking=False)  # released
    kt_oracle.LOCKS[oracle].release()


@covers(
    "retry_queue",
    "set_retry_queue",
    "run_times",
    "oracle_project_dir",
    "set_oracle_project_dir",
    "oracle_file",
    "trial_dir",
    "replace_save_trial",
    "random_unseen_values",
)
def test_kt_oracle_internals(kt, tmp_path):
    oracle = kt.oracles.RandomSearchOracle(objective="loss", max_trials=2)
    _upstream.set_oracle_project_dir(oracle, str(tmp_path), "p")
    assert _upstream.oracle_project_dir(oracle) == os.path.join(str(tmp_path), "p")
    assert _upstream.oracle_file(oracle) == os.path.join(str(tmp_path), "p", "oracle.json")
    assert _upstream.trial_dir(oracle, "7") == os.path.join(str(tmp_path), "p", "trial_7")
    saved = []
    _upstream.replace_save_trial(oracle, saved.append)
    oracle.update_space(kt.HyperParameters())
    trial = oracle.create_trial("tuner0")
    assert _upstream.run_times(oracle)[trial.trial_id] == 0
    oracle.update_trial(trial.trial_id, {"loss": 1.0})
    trial.status = "COMPLETED"
    oracle.end_trial(trial)
    assert _upstream.run_times(oracle)[trial.trial_id] == 1
    assert [t.trial_id for t in saved][-1] == trial.trial_id
    assert _upstream.retry_queue(oracle) == []
    _upstream.set_retry_queue(oracle, [trial.trial_id])
    assert _upstream.retry_queue(oracle) == [trial.trial_id]
    space = kt.HyperParameters()
    space.Choice("units", [4, 8])
    oracle = kt.oracles.RandomSearchOracle(objective="loss", max_trials=5, hyperparameters=space)
    _upstream.set_oracle_project_dir(oracle, str(tmp_path), "q")
    drawn = oracle.create_trial("tuner0").hyperparameters.values["units"]
    assert _upstream.random_unseen_values(oracle) == {"units": 12 - drawn}


@covers(
    "is_worker",
    "tuner_file",
    "checkpoint_file",
    "build_config_file",
    "copy_callbacks",
    "configure_tensorboard_dir",
    "run_and_update_trial",
)
def test_kt_tuner_internals(kt, tmp_path):
    tuner = _tiny_tuner(kt, tmp_path)
    assert _upstream.is_worker(tuner) is False
    assert _upstream.tuner_file(tuner).endswith(os.path.join("p", "tuner0.json"))
    assert os.path.basename(os.path.dirname(_upstream.checkpoint_file(tuner, "00"))) == ("trial_00")
    assert _upstream.build_config_file(tuner, "00").endswith("build_config.json")
    callbacks = [keras.callbacks.TensorBoard(str(tmp_path / "tb"))]
    copies = _upstream.copy_callbacks(tuner, callbacks)
    assert copies[0] is not callbacks[0]
    trial = tuner.oracle.create_trial(tuner.tuner_id)
    _upstream.configure_tensorboard_dir(tuner, copies, trial)
    # KerasTuner gives each trial and execution its own directory on TensorFlow only.
    on_tf = keras.backend.backend() == "tensorflow"
    assert (os.path.basename(os.path.dirname(copies[0].log_dir)) == trial.trial_id) == on_tf
    log_dirs = []
    for execution in (0, 1):
        callbacks = [keras.callbacks.TensorBoard(str(tmp_path / "tb"))]
        _upstream.configure_tensorboard_dir(tuner, callbacks, trial, execution)
        log_dirs.append(callbacks[0].log_dir)
    # KerasTuner gives each execution its own directory on TensorFlow only.
    expected = (
        ["execution0", "execution1"] if keras.backend.backend() == "tensorflow" else ["tb"] * 2
    )
    assert [os.path.basename(d) for d in log_dirs] == expected
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 1), "float32")
    _upstream.run_and_update_trial(tuner, trial, x, y, epochs=1, verbose=0)
    assert tuner.oracle.get_trial(trial.trial_id).metrics.exists("loss")


@covers("kt_protos", "oracle_servicer_class", "is_chief_oracle", "has_chief_oracle")
def test_kt_distributed_internals(kt, monkeypatch):
    monkeypatch.delenv("KERASTUNER_ORACLE_IP", raising=False)
    assert _upstream.has_chief_oracle() is False
    protos = _upstream.kt_protos()
    assert hasattr(protos.get_service(), "CreateTrialResponse")
    assert hasattr(protos.get_service_grpc(), "add_OracleServicer_to_server")
    servicer = _upstream.oracle_servicer_class()
    assert hasattr(servicer, "CreateTrial") and hasattr(servicer, "EndTrial")
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "chief")
    monkeypatch.setenv("KERASTUNER_ORACLE_IP", "127.0.0.1")
    monkeypatch.setenv("KERASTUNER_ORACLE_PORT", "8000")
    assert _upstream.is_chief_oracle() is True
    assert _upstream.has_chief_oracle() is True
    monkeypatch.setenv("KERASTUNER_TUNER_ID", "tuner0")
    assert _upstream.is_chief_oracle() is False


def test_every_accessor_has_a_test():
    accessors = {
        name
        for name, value in vars(_upstream).items()
        if inspect.isfunction(value)
        and value.__module__ == _upstream.__name__
        and not name.startswith("_")
    }
    assert accessors - TESTED == set()
    assert TESTED - accessors == set()
