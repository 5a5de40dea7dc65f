"""Models shared by the ModelPack tests."""

import keras
import numpy as np


def mlp(
    width: int, inputs: int = 10, seed: int = 0, name: str | None = None, out: str = "sigmoid"
) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1, activation=out),
        ],
        name=name,
    )


def functional(seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10,), name="features")
    h = keras.layers.Dense(12, activation="tanh")(inputs)
    skip = keras.layers.Dense(12)(inputs)
    h = keras.layers.Add()([h, skip])
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))


class Subclassed(keras.Model):
    def __init__(self, width=6, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.out = keras.layers.Dense(1, activation="sigmoid")

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "width": self.width}


def subclassed(seed: int = 2) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = Subclassed()
    model(np.zeros((1, 10), "float32"))
    return model


def copy_model(model: keras.Model) -> keras.Model:
    """A same-architecture model with the same initial weights."""
    if isinstance(model, Subclassed):
        twin = Subclassed(model.width)
        twin(np.zeros((1, 10), "float32"))
    else:
        twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def assert_weights_close(a: keras.Model, b: keras.Model, atol: float = 2e-5) -> None:
    wa, wb = a.get_weights(), b.get_weights()
    assert len(wa) == len(wb)
    for va, vb in zip(wa, wb):
        np.testing.assert_allclose(va, vb, atol=atol, rtol=1e-4)
