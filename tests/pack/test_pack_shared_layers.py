"""Members that share a layer object: never silently untied.

Two members holding one layer (a shared encoder, tied weights) are not two independent fits:
both update the one layer. The reference is those two fits interleaved batch by batch in
member order (member 0's `train_on_batch`, then member 1's, each with its own optimizer),
which is what the graph engine's step does; a Keras model with both members' outputs trained
on the sum of their losses is a different training (one gradient step on the shared layer
per batch, not two). The fused engine would stack a copy per member, so on TensorFlow such
members train on the graph engine and the others stay fused; on other backends the pack
refuses at construction. Runs on TensorFlow, JAX and torch.
"""

import keras
import numpy as np
import pytest
from keras import layers

import keras_gpushare as kg
from keras_gpushare.pack.planner import shared_weights

TENSORFLOW = keras.backend.backend() == "tensorflow"
RNG = np.random.default_rng(0)
X = RNG.normal(size=(96, 6)).astype("float32")
Y = RNG.normal(size=(96, 1)).astype("float32")
EPOCHS, BATCH = 2, 16


def build():
    """Members 0 and 1 share the layer `shared`; members 2 and 3 have their own layers."""
    keras.utils.set_random_seed(0)
    shared = layers.Dense(8, activation="relu", name="shared")
    members = []
    for i in range(2):
        inputs = keras.Input((6,))
        members.append(keras.Model(inputs, layers.Dense(1, name=f"head{i}")(shared(inputs))))
    for _ in range(2):
        inputs = keras.Input((6,))
        hidden = layers.Dense(8, activation="relu")(inputs)
        members.append(keras.Model(inputs, layers.Dense(1)(hidden)))
    return members


def optimizers():
    return [
        keras.optimizers.Adam(0.01),
        keras.optimizers.SGD(0.05, momentum=0.5),
        keras.optimizers.Adam(0.02),
        keras.optimizers.SGD(0.1, momentum=0.5),
    ]


def interleaved_fits(members):
    """Every member's fit, batch by batch in member order: the mean batch loss per epoch."""
    for member, optimizer in zip(members, optimizers()):
        member.compile(optimizer=optimizer, loss="mse")
    losses = [[] for _ in members]
    for _ in range(EPOCHS):
        batches = [[] for _ in members]
        for start in range(0, len(X), BATCH):
            for i, member in enumerate(members):
                batch = slice(start, start + BATCH)
                batches[i].append(float(member.train_on_batch(X[batch], Y[batch])))
        for i, values in enumerate(batches):
            losses[i].append(np.mean(values))
    return losses


@pytest.mark.skipif(not TENSORFLOW, reason="the graph engine is TensorFlow's")
@pytest.mark.parametrize("fuse", ["auto", False])
def test_members_sharing_a_layer_train_as_interleaved_fits(fuse):
    pack = kg.ModelPack(build(), fuse=fuse)
    assert pack.engine_plan.graph[:2] == (0, 1)
    if fuse == "auto":
        assert pack.engine == "mixed" and pack.engine_plan.groups == [(2, 3)]
        assert "member 0 on the graph engine: it shares layer `shared` with member 1" in (
            pack.fusion_report
        )
    pack.compile(optimizer=optimizers(), loss="mse")
    history = pack.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    twins = build()
    losses = interleaved_fits(twins)
    for i, twin in enumerate(twins):
        for a, b in zip(pack.members[i].get_weights(), twin.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], losses[i], rtol=1e-5)
    # The views and the standalone copies keep the shared layer as trained, once.
    predictions = pack.predict(X, verbose=0)
    for i in range(4):
        np.testing.assert_allclose(
            predictions[i], pack.member(i).predict(X, verbose=0), rtol=1e-5, atol=1e-6
        )
    assert pack.members[0].get_layer("shared") is pack.members[1].get_layer("shared")


@pytest.mark.skipif(not TENSORFLOW, reason="the graph engine is TensorFlow's")
def test_fuse_true_refuses_members_that_share_a_layer():
    with pytest.raises(ValueError, match=r"member 0: it shares layer `shared` with member 1"):
        kg.ModelPack(build(), fuse=True)


@pytest.mark.skipif(TENSORFLOW, reason="on TensorFlow the graph engine trains them")
def test_members_sharing_a_layer_are_refused_without_the_graph_engine():
    with pytest.raises(
        ValueError,
        match=r"members 0, 1 share layers \(member 0 shares layer `shared` with member 1\)"
        r".*Give each member its own layers.*one member.*TensorFlow backend",
    ):
        kg.ModelPack(build())


class TiedTranspose(layers.Layer):
    """A decoder reading another layer's kernel, transposed (tied weights)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.tied_kernel = source.kernel

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.tied_kernel))


def test_tied_weights_are_found_without_a_shared_layer():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    encoder = layers.Dense(3, name="encoder")
    autoencoder = keras.Model(inputs, layers.Dense(6)(encoder(inputs)))
    inputs = keras.Input((3,))
    decoder = keras.Model(inputs, TiedTranspose(encoder)(inputs))
    found = shared_weights([autoencoder, decoder, build()[2]])
    assert sorted(found) == [0, 1], found
    assert "weight `encoder/kernel` with member 1" in found[0], found
