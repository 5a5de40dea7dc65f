"""The search spaces and data of benchmarks/tuner.py and gpu_table.py's tuner table.

Importing it needs Keras and KerasTuner on any backend, not TensorFlow (the GPU machine has
none); the hypermodels are at module level so that the processes executor's workers import
them.
"""

from __future__ import annotations

import keras
import keras_tuner
import numpy as np

FEATURES = 20


def build(hp: keras_tuner.HyperParameters) -> keras.Model:
    """The searched model: a 20-units-1 MLP with dropout."""
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(hp.Choice("units", [32, 64, 128]), activation="relu"),
            keras.layers.Dropout(hp.Float("dropout", 0.0, 0.5, step=0.1)),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(hp.Float("lr", 1e-4, 1e-2, sampling="log")),
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    return model


def build_getting_started(hp: keras_tuner.HyperParameters) -> keras.Model:
    """KerasTuner's getting-started search space (its tutorial's `build_model`)."""
    model = keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten()])
    for i in range(hp.Int("num_layers", 1, 3)):
        model.add(
            keras.layers.Dense(
                hp.Int(f"units_{i}", min_value=32, max_value=256, step=32),
                activation=hp.Choice("activation", ["relu", "tanh"]),
            )
        )
    if hp.Boolean("dropout"):
        model.add(keras.layers.Dropout(rate=0.25))
    model.add(keras.layers.Dense(10, activation="softmax"))
    lr = hp.Float("lr", min_value=1e-4, max_value=1e-2, sampling="log")
    optimizer = hp.Choice("optimizer", ["adam", "sgd"])
    model.compile(
        optimizer=keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": lr}}),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def build_depths(hp: keras_tuner.HyperParameters) -> keras.Model:
    """Issue 58's space: 1-3 Dense layers of 16-128 units (step 16), relu or tanh, Adam or
    SGD with momentum 0.9, a log learning rate; 20 features in, one sigmoid unit out."""
    model = keras.Sequential([keras.Input((FEATURES,))])
    for i in range(hp.Int("layers", 1, 3)):
        units = hp.Int(f"units_{i}", 16, 128, step=16)
        model.add(keras.layers.Dense(units, activation=hp.Choice("activation", ["relu", "tanh"])))
    model.add(keras.layers.Dense(1, activation="sigmoid"))
    lr = hp.Float("lr", 1e-4, 1e-2, sampling="log")
    if hp.Choice("optimizer", ["adam", "sgd"]) == "adam":
        optimizer = keras.optimizers.Adam(lr)
    else:
        optimizer = keras.optimizers.SGD(lr, momentum=0.9)
    model.compile(optimizer, loss="binary_crossentropy", metrics=["accuracy"])
    return model


SPACES = {"small": build, "getting-started": build_getting_started, "depths": build_depths}


def make_data(samples: int, space: str) -> tuple:
    """Synthetic data for `space`: MNIST-shaped for getting-started, 20 features else."""
    rng = np.random.default_rng(0)
    if space == "getting-started":
        x = rng.random(size=(samples, 28, 28)).astype("float32")
        w = rng.normal(size=(28 * 28, 10)).astype("float32")
        return x, np.argmax(x.reshape(samples, -1) @ w, axis=1).astype("int32")
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.3 * rng.normal(size=(samples, 1)) > 0).astype("float32")
    return x, y
