"""Train several Keras models at once inside one `fit` (the seeds' scenario, redone).

The seeds ran N copies of a small MLP as N processes (method 1) or a hand-written loop of
GradientTapes (method 2). Here the members may differ (widths, learning rates) and train in
one ModelPack: one `fit`, Keras's callbacks, per-member logs, early stopping per member.

    python examples/pack_basic.py
"""

import os
import tempfile

import keras
import numpy as np

import keras_gpushare as kg

QUICK = os.environ.get("KERAS_GPUSHARE_QUICK") == "1"  # the test suite's short run


def build(width: int) -> keras.Model:
    """The seeds' model with a first hidden layer of `width` units."""
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def main() -> None:
    samples, epochs = (2_000, 1) if QUICK else (100_000, 10)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 10)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) + 0.5 * rng.normal(size=(samples, 1)) > 0).astype(
        "float32"
    )

    widths = [16, 32, 48, 64]
    rates = [1e-3, 3e-3]
    members = [build(w) for w in widths for _ in rates]
    pack = kg.ModelPack(members)
    pack.compile(
        optimizer=[keras.optimizers.Adam(lr) for _ in widths for lr in rates],
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    print(f"{len(members)} members on the {pack.engine} engine")
    pack.summary()  # one row per member: where it trains, its own parameters, its optimizer

    log_dir = tempfile.mkdtemp()
    history = pack.fit(
        x,
        y,
        batch_size=32,
        epochs=epochs,
        validation_split=0.1,
        verbose=2,
        callbacks=[
            kg.callbacks.MemberEarlyStopping(
                monitor="val_loss", patience=2, restore_best_weights=True
            ),
            keras.callbacks.CSVLogger(os.path.join(log_dir, "pack.csv")),
        ],
    )

    val = {i: history.history[f"val_m{i}_accuracy"][-1] for i in range(len(members))}
    best = max(val, key=val.get)
    for i, state in enumerate(pack.status):
        lr = rates[i % len(rates)]
        width = widths[i // len(rates)]
        print(f"member {i}: width {width:>2}, lr {lr:g}: val accuracy {val[i]:.3f} ({state})")
    path = os.path.join(log_dir, "best.keras")
    pack.member(best).save(path)
    print(f"best member {best} saved as a plain Keras model: {path}")


if __name__ == "__main__":
    main()
