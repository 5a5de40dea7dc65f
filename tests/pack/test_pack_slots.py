"""`ModelPack.load_member` and `reset_member`: a member's slot refilled in place.

A model loaded into a member that trained before (a slot used by another model) trains as
the same model alone with plain Keras from the same initial weights: weights, optimizer
state, step count and logged loss, whether it is loaded between two fits or from a callback
at an epoch's end (the pack's step is kept, not traced again). The members around it go on
as if nothing happened. Runs on TensorFlow and JAX (and the graph engine on TensorFlow).
"""

import keras
import numpy as np
import pytest
from unfused_layers import Scale

import keras_gpushare as kg

BATCH = 16
ATOL = 1e-5


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, :2].sum(axis=1, keepdims=True)).astype("float32")
    return x, y


def _model(seed, rate=1e-2, custom=False, units=8, beta_1=0.9, family=None):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,))]
    if custom:
        layers.append(Scale())
    layers += [keras.layers.Dense(units, activation="tanh"), keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    optimizer = keras.optimizers.Adam(rate, beta_1=beta_1) if family is None else family(rate)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def _alone(seed, rate, epochs, weights=None, custom=False):
    """A model trained alone with plain Keras (from `weights` when given)."""
    model = _model(seed, rate, custom)
    if weights is not None:
        model.set_weights(weights)
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def _pack(custom=False):
    members = [_model(seed, rate, custom) for seed, rate in ((0, 1e-2), (1, 3e-3), (2, 1e-2))]
    pack = kg.ModelPack(members)
    pack.compile()
    return pack, [m.get_weights() for m in members]


def _assert_same(model, reference):
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=ATOL)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)
    for got, want in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(got), keras.ops.convert_to_numpy(want), atol=ATOL
        )


ENGINES = [False]
if keras.backend.backend() == "tensorflow":
    ENGINES.append(True)


@pytest.mark.parametrize("custom", ENGINES, ids=lambda c: "graph" if c else "fused")
def test_loaded_model_trains_as_it_would_alone(custom):
    x, y = _data()
    pack, initial = _pack(custom)
    assert pack.engine == ("graph" if custom else "fused")
    pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    newcomer = _model(7, rate=5e-3, custom=custom)
    start = newcomer.get_weights()
    pack.load_member(1, newcomer)
    assert pack.status == ["active"] * 3
    history = pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history

    reference, logs = _alone(7, 5e-3, 2, start, custom)
    _assert_same(pack.member(1), reference)
    np.testing.assert_allclose(history["m1_loss"], logs["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["m1_mae"], logs["mae"], rtol=1e-5)
    # Its neighbours went on through both fits as one fit of four epochs.
    for index, (seed, rate) in ((0, (0, 1e-2)), (2, (2, 1e-2))):
        neighbour, _ = _alone(seed, rate, 4, initial[index], custom)
        _assert_same(pack.member(index), neighbour)


def test_loading_at_an_epoch_end_refills_the_slot_without_a_new_step():
    x, y = _data()
    pack, _ = _pack()
    newcomer = _model(7, rate=5e-3)
    start = newcomer.get_weights()
    traces = []
    step = pack.train_step

    def counted_step(*args):
        # Python runs here once per trace (TensorFlow, JAX), at every step in eager torch.
        traces.append(1)
        return step(*args)

    pack.train_step = counted_step
    traced_before = []

    class Refill(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                traced_before.append(len(traces))
                pack.load_member(2, newcomer)

    pack.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[Refill()])
    reference, _ = _alone(7, 5e-3, 2, start)
    _assert_same(pack.member(2), reference)
    if keras.backend.backend() != "torch":
        assert traced_before[0] >= 1
        assert len(traces) == traced_before[0]


def test_reset_member_restarts_its_optimizer_and_keeps_its_weights():
    x, y = _data()
    pack, _ = _pack()
    pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    pack.stop_member(0)
    trained = pack.member(0).get_weights()
    pack.reset_member(0)
    assert pack.status[0] == "active"
    assert int(pack.member(0).optimizer.iterations) == 0
    pack.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    reference, _ = _alone(0, 1e-2, 1, trained)
    _assert_same(pack.member(0), reference)


@pytest.mark.parametrize(
    "newcomer, words",
    [
        (lambda: _model(7, units=4), "units"),
        (lambda: _model(7, beta_1=0.8), "beta_1"),
        (lambda: _compiled(_model(7), loss="mae"), "loss"),
        (lambda: _stepped(_model(7)), "taken 4 steps"),
        (lambda: keras.Sequential([keras.layers.Dense(1)]), "not built"),
    ],
    ids=["width", "optimizer", "loss", "optimizer state", "unbuilt"],
)
def test_a_model_that_does_not_match_is_refused_before_anything_changes(newcomer, words):
    pack, initial = _pack()
    with pytest.raises(ValueError, match=words):
        pack.load_member(1, newcomer())
    for got, want in zip(pack.member(1).get_weights(), initial[1]):
        np.testing.assert_array_equal(got, want)


def test_load_member_needs_a_compiled_pack_and_a_model():
    pack = kg.ModelPack([_model(0), _model(1)])
    with pytest.raises(ValueError, match="not compiled"):
        pack.load_member(0, _model(2))
    pack.compile()
    with pytest.raises(TypeError, match="keras.Model"):
        pack.load_member(0, [1, 2])
    with pytest.raises(ValueError, match="member index 5"):
        pack.load_member(5, _model(2))


FAMILIES = {
    "adagrad": lambda rate: keras.optimizers.Adagrad(rate, initial_accumulator_value=0.5),
    "nadam": keras.optimizers.Nadam,
    "momentum": lambda rate: keras.optimizers.SGD(rate, momentum=0.9),
    "mixed_precision": lambda rate: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(rate), initial_scale=2.0**10
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_optimizer_family_restarts_from_its_own_initial_state(family):
    """Adagrad's accumulators start at its initial value, Nadam's momentum product at 1,
    a loss-scale optimizer's scale at its initial scale: a refilled slot starts from them."""
    x, y = _data()
    make = FAMILIES[family]
    members = [_model(seed, 1e-2, family=make) for seed in (0, 1)]
    pack = kg.ModelPack(members)
    pack.compile()
    pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    newcomer = _model(7, 5e-3, family=make)
    start = newcomer.get_weights()
    pack.load_member(0, newcomer)
    pack.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    reference = _model(7, 5e-3, family=make)
    reference.set_weights(start)
    reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_same(pack.member(0), reference)


def _compiled(model, loss):
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=["mae"])
    return model


def _stepped(model):
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return model


def _sized(seed, units, activation, rate=5e-3, dropout=0.0, optimizer=None):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(units, activation=activation),
            keras.layers.Dropout(dropout),
            keras.layers.Dense(units // 2 + 1, activation=activation),
            keras.layers.Dense(1),
        ]
    )
    optimizer = keras.optimizers.Adam(rate) if optimizer is None else optimizer()
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def _slot_pack():
    specs = ((0, 8, "relu"), (1, 16, "tanh"), (2, 12, "relu"))
    members = [_sized(seed, units, activation) for seed, units, activation in specs]
    initial = [m.get_weights() for m in members]
    pack = kg.ModelPack(members, _slot_values=True)
    pack.compile()
    return pack, specs, initial


def _sized_alone(seed, units, activation, epochs, weights, rate=5e-3, optimizer=None):
    model = _sized(seed, units, activation, rate, optimizer=optimizer)
    model.set_weights(weights)
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def test_a_slot_pack_takes_models_of_other_widths_and_activations():
    """Fused layers built for slots hold widths, activations and dropout rates as data:
    a member of another width and activation loads in place and trains as it would alone."""
    x, y = _data()
    pack, specs, initial = _slot_pack()
    pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    newcomer = _sized(7, 10, "relu")
    start = newcomer.get_weights()
    pack.load_member(1, newcomer)
    assert [w.shape for w in pack.member(1).get_weights()] == [w.shape for w in start]
    history = pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history

    reference, logs = _sized_alone(7, 10, "relu", 2, start)
    _assert_same(pack.member(1), reference)
    np.testing.assert_allclose(history["m1_loss"], logs["loss"], rtol=1e-5)
    for index in (0, 2):
        seed, units, activation = specs[index]
        neighbour, _ = _sized_alone(seed, units, activation, 4, initial[index], rate=5e-3)
        _assert_same(pack.member(index), neighbour)
    # The slot can take its first member back.
    again = _sized(1, 16, "tanh")
    pack.load_member(1, again)
    np.testing.assert_array_equal(pack.member(1).get_weights()[0], again.get_weights()[0])


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(5e-3),
    "sgd momentum": lambda: keras.optimizers.SGD(2e-2, momentum=0.9),
    "adamw": lambda: keras.optimizers.AdamW(4e-3, weight_decay=0.05, beta_2=0.99),
    "sgd nesterov": lambda: keras.optimizers.SGD(1e-2, momentum=0.8, nesterov=True),
    "adam other betas": lambda: keras.optimizers.Adam(3e-3, beta_1=0.8, epsilon=1e-5),
    "adam no decay": lambda: keras.optimizers.AdamW(6e-3, weight_decay=0.0),
}


def test_a_slot_pack_takes_other_optimizer_families_and_hyperparameters():
    """The vectorized optimizer of a slot pack holds each member's family, hyperparameters
    and weight decay as data: a slot of an Adam member takes an SGD trial and the other
    way round, and each trains as it would alone, as do its untouched neighbours."""
    x, y = _data()
    specs = [(0, 8, "relu", "adam"), (1, 16, "tanh", "sgd momentum"), (2, 12, "relu", "adamw")]
    specs.append((3, 8, "tanh", "adam"))
    members = [_sized(s, u, a, optimizer=OPTIMIZERS[o]) for s, u, a, o in specs]
    initial = [m.get_weights() for m in members]
    pack = kg.ModelPack(members, _slot_values=True)
    pack.compile()
    pack.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    loads = {0: (7, 10, "relu", "sgd nesterov"), 1: (8, 12, "tanh", "adam other betas")}
    loads[2] = (9, 16, "relu", "adam no decay")
    starts = {}
    for index, (seed, units, activation, name) in loads.items():
        newcomer = _sized(seed, units, activation, optimizer=OPTIMIZERS[name])
        starts[index] = newcomer.get_weights()
        pack.load_member(index, newcomer)
    history = pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history

    for index, (seed, units, activation, name) in loads.items():
        reference, logs = _sized_alone(
            seed, units, activation, 2, starts[index], optimizer=OPTIMIZERS[name]
        )
        _assert_same(pack.member(index), reference)
        np.testing.assert_allclose(history[f"m{index}_loss"], logs["loss"], rtol=1e-5)
    seed, units, activation, name = specs[3]
    neighbour, _ = _sized_alone(seed, units, activation, 3, initial[3], optimizer=OPTIMIZERS[name])
    _assert_same(pack.member(3), neighbour)


def _tensorflow_cpu():
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return not tf.config.list_physical_devices("GPU")


@pytest.mark.skipif(
    not _tensorflow_cpu(), reason="elsewhere XLA (or a GPU) fuses the step's update already"
)
def test_a_slot_packs_update_is_compiled_once_with_xla_on_a_tensorflow_cpu():
    """With `fuse_update` (ParallelTuner's slots executor sets it for long searches), the
    update of a pack built for slots (every family's rule over every slot) runs on a
    TensorFlow CPU as one XLA-compiled function inside the traced step, compiled once for
    the program's life: fits and loads into its slots trace it again neither, and a loaded
    model trains as it would alone."""
    x, y = _data()
    specs = [(0, 8, "relu", "adam"), (1, 16, "tanh", "sgd momentum")]
    members = [_sized(s, u, a, optimizer=OPTIMIZERS[o]) for s, u, a, o in specs]
    pack = kg.ModelPack(members, _slot_values=True)
    pack.compile()
    assert pack.optimizer.fuse_update is False
    pack.optimizer.fuse_update = True
    pack.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    newcomer = _sized(7, 10, "relu", optimizer=OPTIMIZERS["sgd nesterov"])
    start = newcomer.get_weights()
    pack.load_member(1, newcomer)
    pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    _, update, _ = pack.optimizer._fused_update.value
    assert update.experimental_get_tracing_count() == 1
    reference, _ = _sized_alone(7, 10, "relu", 2, start, optimizer=OPTIMIZERS["sgd nesterov"])
    _assert_same(pack.member(1), reference)


@pytest.mark.parametrize(
    "optimizer, words",
    [
        (lambda: keras.optimizers.RMSprop(1e-3), "not one this program was compiled with"),
        (lambda: keras.optimizers.Adam(1e-3, amsgrad=True), "velocity_hat"),
        (lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.1), "without weight decay"),
        (lambda: keras.optimizers.Adam(1e-3, clipnorm=1.0), "clip"),
    ],
    ids=["other family", "other slots", "weight decay", "clipping"],
)
def test_a_slot_pack_refuses_an_optimizer_its_step_does_not_hold(optimizer, words):
    members = [_sized(0, 8, "relu"), _sized(1, 8, "relu", optimizer=OPTIMIZERS["sgd momentum"])]
    pack = kg.ModelPack(members, _slot_values=True)
    pack.compile()
    with pytest.raises(ValueError, match=words):
        pack.load_member(1, _sized(7, 8, "relu", optimizer=optimizer))


@pytest.mark.parametrize(
    "newcomer, words",
    [
        (lambda: _sized(7, 32, "relu"), "at most"),
        (lambda: _sized(7, 8, "sigmoid"), "activation 'sigmoid'"),
        (lambda: _deep(7, 5), "its layers are Dense, Dense, Dense, Dense, Dense"),
    ],
    ids=["too wide", "other activation", "other layers"],
)
def test_a_slot_pack_refuses_what_its_slots_do_not_hold(newcomer, words):
    pack, _, initial = _slot_pack()
    with pytest.raises(ValueError, match=words):
        pack.load_member(1, newcomer())
    for got, want in zip(pack.member(1).get_weights(), initial[1]):
        np.testing.assert_array_equal(got, want)


def _deep(seed, hidden):
    """A model of `hidden` Dense layers before its output, and no Dropout."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,))]
    layers += [keras.layers.Dense(8, activation="tanh") for _ in range(hidden)]
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("hidden", [1, 2])
def test_a_slot_pack_takes_models_of_another_depth(hidden):
    """The slot's layers that keep their input's width may be left out: a model without
    the Dropout and with one or two hidden layers loads and trains as it would alone, and
    its neighbours as theirs."""
    x, y = _data()
    pack, specs, initial = _slot_pack()
    newcomer = _deep(7, hidden)
    start = newcomer.get_weights()
    pack.load_member(1, newcomer)
    assert [w.shape for w in pack.member(1).get_weights()] == [w.shape for w in start]
    history = pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history

    reference = _deep(7, hidden)
    reference.set_weights(start)
    logs = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    _assert_same(pack.member(1), reference)
    np.testing.assert_allclose(history["m1_loss"], logs["loss"], rtol=1e-5)
    seed, units, activation = specs[0]
    neighbour, _ = _sized_alone(seed, units, activation, 2, initial[0])
    _assert_same(pack.member(0), neighbour)
    # The slot takes a model of the full depth back.
    pack.load_member(1, _sized(3, 12, "tanh"))
    pack.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def test_a_loaded_dropout_rate_is_the_members_own():
    pack, _, _ = _slot_pack()
    pack.load_member(0, _sized(7, 8, "relu", dropout=0.5))
    fused = pack._engines[0].fused
    dropout = next(layer for layer in fused.graph.layers if hasattr(layer, "slot_rate"))
    out = keras.ops.convert_to_numpy(dropout(keras.ops.ones((3, 400, 16)), training=True))
    kept = out[0] != 0
    assert 0.4 < kept.mean() < 0.6
    np.testing.assert_allclose(out[0][kept], 2.0)
    np.testing.assert_array_equal(out[1], 1.0)


def test_a_pack_with_members_loaded_by_values_is_saved_member_by_member(tmp_path):
    pack, _, _ = _slot_pack()
    pack.save(tmp_path / "before.keras")
    pack.load_member(1, _sized(7, 10, "relu"))
    with pytest.raises(ValueError, match=r"pack.member\(i\).save"):
        pack.save(tmp_path / "after.keras")
    pack.member(1).save(tmp_path / "member.keras")
    assert keras.models.load_model(tmp_path / "member.keras").layers[0].units == 10


def _flat(seed, units, shape=(2, 3)):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input(shape),
            keras.layers.Flatten(),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("shape", [(2, 3), (6,)])
def test_a_slot_behind_a_per_sample_layer_takes_a_model_by_values(shape):
    """A `Flatten` (fused as a per-sample wrapper, which keeps its layer serialized) is
    compared by its config: a narrower model loads by values and trains as alone. On a
    flat input the `Flatten` keeps its input's shape but is computed once for all slots
    (not stacked): no slot skips it."""
    x, y = _data()
    x = x.reshape(-1, *shape)
    pack = kg.ModelPack([_flat(0, 8, shape), _flat(1, 16, shape)], _slot_values=True)
    pack.compile()
    newcomer = _flat(7, 4, shape)
    start = newcomer.get_weights()
    assert pack.load_problem(0, newcomer) is None
    pack.load_member(0, newcomer)
    pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    reference = _flat(7, 4, shape)
    reference.set_weights(start)
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    _assert_same(pack.member(0), reference)


def _layered(seed, hidden, features=32):
    """A model of `hidden` Dense layers (`(units, activation)` each) before its output."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(units, activation=a) for units, a in hidden]
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def _wide_data(features=32):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, features)).astype("float32")
    return x, x[:, :3].sum(axis=1, keepdims=True)


def test_searched_layers_of_a_slot_pack_share_one_capacity():
    """Built for slots, the Dense layers that differ between members (a depth search's
    hidden layers) hold the widest width and every activation of any of them: a model
    whose second layer is wider than, and of another activation from, every member's
    second layer loads and trains as it would alone."""
    x, y = _wide_data()
    members = [_layered(0, [(16, "relu"), (8, "relu")]), _layered(1, [(16, "tanh")])]
    pack = kg.ModelPack(members, _slot_values=True)
    pack.compile()
    newcomer = _layered(7, [(8, "tanh"), (16, "tanh")])
    start = newcomer.get_weights()
    pack.load_member(1, newcomer)
    history = pack.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history

    reference = _layered(7, [(8, "tanh"), (16, "tanh")])
    reference.set_weights(start)
    logs = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    _assert_same(pack.member(1), reference)
    np.testing.assert_allclose(history["m1_loss"], logs["loss"], rtol=1e-5)


def test_a_capacity_that_costs_too_much_is_not_shared():
    """Sharing stops where it would make each step much dearer (here a 64-wide second
    layer for members whose second layer is 4 wide): that layer keeps its members' width,
    and a wider model is refused, saying so."""
    members = [_layered(0, [(64, "relu")]), _layered(1, [(4, "relu"), (4, "relu")])]
    pack = kg.ModelPack(members, _slot_values=True)
    pack.compile()
    assert pack.load_problem(0, _layered(7, [(4, "relu"), (4, "relu")])) is None
    with pytest.raises(ValueError, match=r"at most \(64, 4\)"):
        pack.load_member(0, _layered(7, [(4, "relu"), (8, "relu")]))
