"""A hand-written search over widths, depths, activations and optimizers, trained fused.

Twelve MLP classifiers that differ the way a KerasTuner search makes them differ: 1-3 hidden
layers of 32-256 units, relu or tanh, Adam or SGD with momentum, each with its own learning
rate. They share a skeleton (Dense layers in a chain), so the pack fuses them: every layer
is stacked at the widest member, each member's weights sit in a corner and the padding stays
zero, shallower members pass through the layers they lack, and each optimizer family updates
its members in one vectorized step. The plan printed first shows the groups and how much of
their work is padding. Member 0 is then trained alone from the same weights, to show the
pack computed exactly what its own `fit` computes.

    python examples/padded_search.py
"""

import os

import keras
import numpy as np

import keras_gpushare as kg

QUICK = os.environ.get("KERAS_GPUSHARE_QUICK") == "1"  # the test suite's short run
FEATURES, CLASSES = 20, 4


def candidate(i: int) -> tuple[keras.Model, keras.optimizers.Optimizer]:
    """Member `i` of the search, and its optimizer."""
    rng = np.random.default_rng(i)
    depth = 1 + i % 3
    widths = rng.choice(np.arange(32, 257, 32), size=depth)
    activation = ("relu", "tanh")[(i // 3) % 2]
    rate = float(10 ** rng.uniform(-3.5, -2))
    keras.utils.set_random_seed(i)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            *[keras.layers.Dense(int(w), activation=activation) for w in widths],
            keras.layers.Dense(CLASSES, activation="softmax"),
        ],
        name=f"candidate_{i}",
    )
    optimizer = keras.optimizers.Adam(rate) if i % 2 == 0 else keras.optimizers.SGD(10 * rate, 0.9)
    return model, optimizer


def data(samples: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, CLASSES)).astype("float32")
    return x, np.argmax(np.tanh(x @ w) + 0.3 * x[:, :CLASSES] ** 2, axis=1)


def main() -> None:
    members, samples, epochs = (3, 256, 1) if QUICK else (12, 20_000, 6)
    x, y = data(samples)
    pack = kg.ModelPack([candidate(i)[0] for i in range(members)])
    print(f"engine: {pack.engine}")
    print(pack.fusion_report.splitlines()[0])
    for line in pack.fusion_report.splitlines():
        if line.startswith(("group", "member")):
            print(line)
    pack.compile(
        optimizer=[candidate(i)[1] for i in range(members)],
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    fit_args = dict(batch_size=64, epochs=epochs, validation_split=0.2, shuffle=False, verbose=0)
    history = pack.fit(x, y, **fit_args)
    scores = [history.history[f"val_m{i}_accuracy"][-1] for i in range(members)]
    for i in np.argsort(scores)[::-1][:3]:
        model = pack.member(int(i))
        hidden = [layer.units for layer in model.layers[:-1]]
        print(f"member {i}: hidden {hidden}, val accuracy {scores[i]:.3f}")

    alone, optimizer = candidate(0)
    alone.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    alone.fit(x, y, **fit_args)
    difference = max(
        float(np.abs(a - b).max())
        for a, b in zip(alone.get_weights(), pack.member(0).get_weights())
    )
    print(f"member 0 in the pack vs trained alone: largest weight difference {difference:.1e}")


if __name__ == "__main__":
    main()
