"""Stream KerasTuner trials through the slots of one compiled program.

KerasTuner's getting-started search space (1 to 3 hidden layers, each with its own units,
one activation, an optional Dropout, Adam or SGD) searched with `executor="slots"`: the
first 8 trials open a program of 8 slots; each later trial is loaded into a slot the moment
one frees, with no new build, trace or compile, and trains exactly as KerasTuner would
train it alone; a trial deeper than every slot (KerasTuner's first trials take the default
of one hidden layer) opens a program of its own. `trial_paths()` says which program and
slot each trial trained in, and why. It is
the default executor on JAX (`KERAS_BACKEND=jax`); on TensorFlow packs are, so it is named
here:

    python examples/tune_slots.py

With `KERAS_GPUSHARE_QUICK=1` it runs 6 trials of one epoch on little data.
"""

import logging
import os
import tempfile

import keras
import numpy as np

import keras_gpushare as kg


def build(hp):
    model = keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten()])
    for i in range(hp.Int("num_layers", 1, 3)):
        units = hp.Int(f"units_{i}", min_value=32, max_value=256, step=32)
        model.add(keras.layers.Dense(units, activation=hp.Choice("activation", ["relu", "tanh"])))
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


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("keras_gpushare.pack").setLevel(logging.WARNING)
    quick = bool(os.environ.get("KERAS_GPUSHARE_QUICK"))
    rng = np.random.default_rng(0)
    samples = 256 if quick else 4096
    x = rng.random(size=(samples, 28, 28)).astype("float32")
    y = np.argmax(x.reshape(samples, -1) @ rng.normal(size=(784, 10)), axis=1).astype("int32")
    tuner = kg.tuner.ParallelTuner(
        build,
        objective="val_loss",
        max_trials=6 if quick else 32,
        parallel_trials=3 if quick else 8,
        executor="slots",
        seed=1,
        directory=tempfile.mkdtemp(prefix="kg-slots-"),
        project_name="getting-started",
    )
    tuner.search(x, y, epochs=1 if quick else 5, batch_size=64, validation_split=0.2)
    for trial_id, path in tuner.trial_paths().items():
        print(f"trial {trial_id}: {path['path']}, program {path.get('program')}: {path['why']}")
    tuner.results_summary(2)


if __name__ == "__main__":
    main()
