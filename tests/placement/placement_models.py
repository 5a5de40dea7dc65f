"""Small models with known answers for the placement tests."""

import keras
import numpy as np


def mlp() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="d1"),
            keras.layers.Dense(8, activation="tanh", name="d2"),
            keras.layers.Dense(8, activation="relu", name="d3"),
            keras.layers.Dense(3, name="out"),
        ],
        name="mlp",
    )


def skip() -> keras.Model:
    keras.utils.set_random_seed(2)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", name="d1")(inputs)
    h2 = keras.layers.Dense(8, activation="tanh", name="d2")(h)
    s = keras.layers.Add(name="add")([h, h2])
    outputs = keras.layers.Dense(3, name="out")(s)
    return keras.Model(inputs, outputs, name="skip")


def multi_io() -> keras.Model:
    keras.utils.set_random_seed(3)
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    ha = keras.layers.Dense(8, activation="relu", name="da")(a)
    hb = keras.layers.Dense(8, activation="relu", name="db")(b)
    h = keras.layers.Concatenate(name="cat")([ha, hb])
    out1 = keras.layers.Dense(3, name="out1")(ha)
    out2 = keras.layers.Dense(1, name="out2")(keras.layers.Dense(5, name="dh")(h))
    return keras.Model([a, b], [out1, out2], name="multi_io")


# model builder, split devices, balance, data
CASES = {
    "mlp": (mlp, ["/CPU:1", "/CPU:2"], "params"),
    "skip": (skip, ["/CPU:1", "/CPU:2", "/CPU:3"], [1, 1, 2]),
    "multi_io": (multi_io, ["/CPU:1", "/CPU:2"], ["cat"]),
}


def data(name: str, n: int = 16):
    rng = np.random.RandomState(0)
    if name == "multi_io":
        x = [rng.randn(n, 6).astype("float32"), rng.randn(n, 4).astype("float32")]
        y = [rng.randn(n, 3).astype("float32"), rng.randn(n, 1).astype("float32")]
        return x, y
    return rng.randn(n, 6).astype("float32"), rng.randn(n, 3).astype("float32")
