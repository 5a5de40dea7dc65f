"""Member models and a backend-neutral gradient helper for the fusion tests."""

import keras
import numpy as np
from keras import layers


def gradients(fn, variables):
    """Gradients of the scalar `fn()` with respect to `variables`, on any backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = fn()
        return [np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(loss, variables)]
    if backend == "jax":
        import jax
        from keras.src.backend.common.stateless_scope import StatelessScope

        def pure(values):
            with StatelessScope(state_mapping=list(zip(variables, values))):
                return fn()

        grads = jax.grad(pure)([v.value for v in variables])
        return [np.asarray(g) for g in grads]
    raise NotImplementedError(backend)


def mlp(seed, units=(64, 32)):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10,))
    x = inputs
    for width in units:
        x = layers.Dense(width, activation="relu")(x)
    return keras.Model(inputs, layers.Dense(1)(x))


def cnn(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            layers.Conv2D(4, 3, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.MaxPooling2D(),
            layers.DepthwiseConv2D(3, padding="same"),
            layers.AveragePooling2D(2),
            layers.Conv2D(5, 2, strides=2),
            layers.GlobalAveragePooling2D(),
            layers.Dense(3, activation="softmax"),
        ]
    )


def text(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((12,), dtype="int32")
    e = layers.Embedding(20, 8)(inputs)
    a = layers.Conv1D(6, 3, padding="causal", activation="relu")(e)
    b = layers.Conv1D(6, 3, padding="same", dilation_rate=2)(e)
    x = layers.Concatenate()([layers.GlobalAveragePooling1D()(a), layers.GlobalMaxPooling1D()(b)])
    return keras.Model(inputs, layers.Dense(2)(layers.LayerNormalization()(x)))


def branches(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="a")
    other = keras.Input((4,), name="b")
    h = layers.Dense(6, activation="tanh")(inputs)
    s = layers.Add()([h, inputs])
    d = layers.Subtract()([s, layers.Dense(6)(other)])
    m = layers.Multiply()([d, h])
    c = layers.Concatenate()([m, layers.Flatten()(layers.Reshape((2, 2))(other))])
    out = layers.Dense(3)(layers.Activation("gelu")(c))
    return keras.Model({"a": inputs, "b": other}, {"out": out, "skip": s})


def twins_of(members):
    """Clones of `members` with the same weights, to train alone beside the pack."""
    twins = [keras.models.clone_model(m) for m in members]
    for member, twin in zip(members, twins):
        twin.set_weights(member.get_weights())
    return twins


def assert_members_match_twins(pack, twins, x, path, saved):
    """Each member equals its twin (weights, predictions); member `saved` reloads from `path`."""
    predictions = pack.predict(x, verbose=0)
    for i, (member, twin) in enumerate(zip(pack.members, twins)):
        for a, b in zip(member.get_weights(), twin.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(predictions[i], twin.predict(x, verbose=0), atol=1e-5)
    pack.member(saved).save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), predictions[saved], atol=1e-5)
