"""A 16-member ensemble trained as one fused model, then averaged.

Members share an architecture and differ in their initial weights (seeds), so the pack
fuses them: stacked weights with a member axis, one batched matmul per Dense layer for all
16, one vectorized Adam. Averaging the members' predictions gives the ensemble.

    python examples/ensemble_fused.py
"""

import os

import keras
import numpy as np

import keras_gpushare as kg

QUICK = os.environ.get("KERAS_GPUSHARE_QUICK") == "1"  # the test suite's short run


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def main() -> None:
    samples, epochs = (1_000, 1) if QUICK else (20_000, 8)
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(3, 20)) * 1.2
    labels = rng.integers(0, 3, size=samples)
    x = (centers[labels] + rng.normal(size=(samples, 20))).astype("float32")
    split = int(0.8 * samples)
    (x_train, y_train), (x_test, y_test) = (x[:split], labels[:split]), (x[split:], labels[split:])

    pack = kg.ModelPack.from_builder(build, n=16)
    print(f"engine: {pack.engine}")
    print(pack.fusion_report)
    pack.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    pack.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=2)

    probabilities = pack.predict(x_test, stack=True, verbose=0)  # (16, samples, 3)
    members = (probabilities.argmax(-1) == y_test).mean(axis=1)
    ensemble = (probabilities.mean(axis=0).argmax(-1) == y_test).mean()
    print(f"members' test accuracy: {members.min():.3f} to {members.max():.3f}")
    print(f"ensemble (mean of 16) : {ensemble:.3f}")


if __name__ == "__main__":
    main()
