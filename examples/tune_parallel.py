"""Tune a small MLP with KerasTuner, 8 trials at a time in ModelPacks.

The same RandomSearch that `keras_tuner.RandomSearch` would run, with each round of 8
trials trained together in one `fit` (same-architecture trials fused). Runs on a CPU in
well under a minute; pass `processes` to use 2 worker processes instead:

    python examples/tune_parallel.py [pack|processes]

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
            keras.layers.Dropout(hp.Float("dropout", 0.0, 0.4, step=0.1)),
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
    executor = sys.argv[1] if len(sys.argv) > 1 else "pack"
    quick = bool(os.environ.get("KERAS_GPUSHARE_QUICK"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 if quick else 2048, 20)).astype("float32")
    y = (x[:, :5].sum(axis=1, keepdims=True) > 0).astype("float32")
    tuner = kg.tuner.ParallelTuner(
        build,
        objective="val_accuracy",
        max_trials=4 if quick else 16,
        parallel_trials=(4 if quick else 8) if executor == "pack" else 2,
        executor=executor,
        seed=1,
        directory=tempfile.mkdtemp(prefix="kg-tune-"),
        project_name="mlp",
    )
    tuner.search(x, y, epochs=1 if quick else 4, batch_size=64, validation_split=0.2)
    tuner.results_summary(3)
    best = tuner.get_best_models(1)[0]
    n_val = len(x) // 5
    print("best model's validation accuracy:", best.evaluate(x[-n_val:], y[-n_val:], verbose=0)[1])


if __name__ == "__main__":
    main()
