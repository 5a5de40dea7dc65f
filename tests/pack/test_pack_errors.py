"""Bad input gets a clear error before any work starts."""

import keras
import numpy as np
import pytest
from pack_builders import mlp

import keras_gpushare as kg


def test_no_members():
    with pytest.raises(ValueError, match="list is empty"):
        kg.ModelPack([])


def test_member_that_is_not_a_model():
    with pytest.raises(TypeError, match="Invalid member 1: expected a `keras.Model`"):
        kg.ModelPack([mlp(4), keras.layers.Dense(3)])


def test_same_model_twice():
    model = mlp(4)
    with pytest.raises(ValueError, match="member 1 is the same model object as member 0"):
        kg.ModelPack([model, model])


def test_optimizer_list_of_wrong_length():
    pack = kg.ModelPack([mlp(4, seed=0), mlp(4, seed=1)])
    with pytest.raises(ValueError, match="got 3 optimizers for 2 members"):
        pack.compile(optimizer=["sgd", "adam", "sgd"], loss="mse")


def test_loss_list_of_wrong_length():
    pack = kg.ModelPack([mlp(4, seed=0), mlp(4, seed=1)])
    with pytest.raises(ValueError, match="got a list of 3 losses for 2 members"):
        pack.compile(optimizer="sgd", loss=["mse", "mse", "mae"])


def test_same_optimizer_instance_for_two_members():
    pack = kg.ModelPack([mlp(4, seed=0), mlp(4, seed=1)])
    opt = keras.optimizers.Adam()
    with pytest.raises(ValueError, match="member 1 and member 0 got the same optimizer"):
        pack.compile(optimizer=[opt, opt], loss="mse")


def test_one_optimizer_instance_is_copied_per_member(binary_data):
    pack = kg.ModelPack([mlp(4, seed=0), mlp(4, seed=1)])
    opt = keras.optimizers.Adam(0.003)
    pack.compile(optimizer=opt, loss="mse")
    optimizers = [m.optimizer for m in pack.members]
    assert optimizers[0] is not optimizers[1] and opt not in optimizers
    # Keras makes names unique within a session: "m0_adam", or "m0_adam_1" if taken.
    assert [o.name.split("_adam")[0] for o in optimizers] == ["m0", "m1"]
    assert float(optimizers[1].learning_rate) == pytest.approx(0.003)


def test_missing_loss():
    pack = kg.ModelPack([mlp(4)])
    with pytest.raises(ValueError, match="argument `loss`: got None"):
        pack.compile(optimizer="sgd")


def test_metric_lists_of_wrong_length():
    pack = kg.ModelPack([mlp(4, seed=0), mlp(4, seed=1)])
    with pytest.raises(ValueError, match="3 per-member metric lists for 2 members"):
        pack.compile(optimizer="sgd", loss="mse", metrics=[["mae"], ["mae"], ["mse"]])


def test_labels_that_do_not_match_outputs(binary_data):
    x, y = binary_data
    pack = kg.ModelPack([mlp(4, seed=0), mlp(4, seed=1)])
    pack.compile(optimizer="sgd", loss="mse")
    weights = [w.copy() for w in pack.members[0].get_weights()]
    with pytest.raises(ValueError, match=r"member 0 .* has 1 output\(s\) but got 2 label"):
        pack.fit(x, [[y, y], [y, y]], epochs=1, verbose=0)
    for a, b in zip(weights, pack.members[0].get_weights()):
        np.testing.assert_array_equal(a, b)


def test_shard_with_fewer_samples_than_members():
    pack = kg.ModelPack([mlp(4, seed=s) for s in range(4)], data="shard")
    pack.compile(optimizer="sgd", loss="mse")
    x = np.zeros((3, 10), "float32")
    with pytest.raises(ValueError, match="3 samples for 4 members"):
        pack.fit(x, np.zeros((3, 1), "float32"), epochs=1, verbose=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"data": "split"}, 'argument `data`: got .split.. Expected "replicate"'),
        ({"fuse": "yes"}, "argument `fuse`"),
        ({"on_nan": "skip"}, "argument `on_nan`"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kg.ModelPack([mlp(4)], **kwargs)


def test_fit_before_compile(binary_data):
    pack = kg.ModelPack([mlp(4)])
    with pytest.raises(RuntimeError, match="call `compile\\(\\)`"):
        pack.fit(*binary_data, epochs=1, verbose=0)


def test_from_builder_with_and_without_index():
    pack = kg.ModelPack.from_builder(lambda i: mlp(4 + i, seed=i), n=3)
    assert [m.layers[0].units for m in pack.members] == [4, 5, 6]
    assert len(kg.ModelPack.from_builder(lambda: mlp(4), n=2).members) == 2
    with pytest.raises(ValueError, match="argument `n`"):
        kg.ModelPack.from_builder(lambda: mlp(4), n=0)


def test_fused_members_reading_different_dict_keys_are_refused():
    def member(seed, name):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((3,), name=name)
        return keras.Model(inputs, keras.layers.Dense(1)(inputs))

    x = {"a": np.ones((8, 3), "float32"), "b": np.full((8, 3), 2.0, "float32")}
    pack = kg.ModelPack([member(0, "a"), member(1, "b")], fuse="auto")
    pack.compile(optimizer="sgd", loss="mse")
    assert pack.engine == "fused"
    for call in (
        lambda: pack.predict(x, verbose=0),
        lambda: pack.fit(x, np.zeros((8, 1)), verbose=0),
        lambda: pack.evaluate(x, np.zeros((8, 1)), verbose=0),
    ):
        with pytest.raises(ValueError, match=r"read different keys of the input dict.*fuse=False"):
            call()
