"""Watch how busy the GPU really is while a Keras model trains.

UtilizationLogger samples NVML on a background thread and writes per-epoch figures into the
logs (so History, CSVLogger and TensorBoard get them). Without a GPU it logs one warning and
writes host figures only. Works with any Keras backend:

    python examples/monitor_fit.py
    KERAS_BACKEND=jax python examples/monitor_fit.py
"""

import logging
import math
import os
import tempfile

import keras
import numpy as np

from keras_gpushare.callbacks import UtilizationLogger


def main():
    # The advice line and the device mapping are logged at INFO.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quick = os.environ.get("KERAS_GPUSHARE_QUICK") == "1"  # the test suite's short run
    rows, epochs = (512, 1) if quick else (8192, 3)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype("float32")
    y = (x[:, :8].sum(axis=1, keepdims=True) > 0).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])

    util = UtilizationLogger(interval=0.2)
    csv_path = os.path.join(tempfile.mkdtemp(), "utilization.csv")
    history = model.fit(
        x,
        y,
        batch_size=128,
        epochs=epochs,
        callbacks=[util, keras.callbacks.CSVLogger(csv_path)],  # the logger comes first
        verbose=2,
    )

    print(f"\nbackend: {keras.backend.backend()}; devices: {util.monitored_devices or 'none'}")
    keys = [k for k in history.history if k.startswith(("gpu", "proc_", "cpu_", "host_"))]
    print(f"{'figure':<22}" + "".join(f"{'epoch ' + str(e):>12}" for e in range(epochs)))
    for key in keys:
        cells = "".join(
            f"{'nan' if math.isnan(v) else f'{v:.1f}':>12}" for v in history.history[key]
        )
        print(f"{key:<22}{cells}")
    print(f"\nCSV with the same columns every epoch: {csv_path}")
    print(util.advice)


if __name__ == "__main__":
    main()
