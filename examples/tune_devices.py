"""Tune a small MLP over every GPU of this machine: one worker process per GPU.

`ParallelTuner(devices="all")` starts one worker per GPU, each pinned to its GPU
(`CUDA_VISIBLE_DEVICES`) and training `parallel_trials` trials at a time there, all
coordinated by KerasTuner's own chief/worker protocol on localhost; `search` runs the chief
and returns when the search is done. On a machine without GPUs, name CPU workers instead
(this script's default, two of them):

    python examples/tune_devices.py all        # every GPU
    python examples/tune_devices.py 0,1        # GPUs 0 and 1
    python examples/tune_devices.py            # two CPU workers

With `KERAS_GPUSHARE_QUICK=1` it runs 4 trials of one epoch on little data.
"""

import logging
import os
import sys
import tempfile

import keras
import numpy as np

import keras_gpushare as kg


def build(hp):
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(hp.Choice("units", [16, 32, 64]), activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(hp.Float("lr", 1e-4, 1e-2, sampling="log")),
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("keras_gpushare.pack").setLevel(logging.WARNING)
    quick = bool(os.environ.get("KERAS_GPUSHARE_QUICK"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 if quick else 2048, 20)).astype("float32")
    y = (x[:, :5].sum(axis=1, keepdims=True) > 0).astype("float32")
    devices = sys.argv[1] if len(sys.argv) > 1 else "cpu0,cpu1"
    tuner = kg.tuner.ParallelTuner(
        build,
        objective="val_accuracy",
        max_trials=4 if quick else 16,
        parallel_trials=2 if quick else 4,
        devices="all" if devices == "all" else devices.split(","),
        seed=1,
        directory=tempfile.mkdtemp(prefix="kg-tune-"),
        project_name="mlp",
    )
    tuner.search(x, y, epochs=1 if quick else 4, batch_size=64, validation_split=0.2)
    tuner.results_summary(3)
    for trial_id, path in tuner.trial_paths().items():
        print(trial_id, path["worker"], path["path"])  # noqa: T201


if __name__ == "__main__":
    main()
