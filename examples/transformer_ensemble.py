"""An ensemble of eight small transformer classifiers trained as one fused pack.

Synthetic token sequences of varying length, padded with 0: the label says whether a
"trigger" token and a "target" token occur together (5% of labels flipped), which a bag of
words cannot read off but one self-attention layer can. Each member is a token embedding
(`mask_zero=True`, so padding is masked in attention and pooling), one MultiHeadAttention
block with residual connections and LayerNormalization, a feed-forward layer, and average
pooling. The pack
fuses the eight: batched projections, one attention for all members; averaging their
probabilities gives the ensemble.

    python examples/transformer_ensemble.py
"""

import os

import keras
import numpy as np

import keras_gpushare as kg

QUICK = os.environ.get("KERAS_GPUSHARE_QUICK") == "1"  # the test suite's short run
VOCABULARY, LENGTH, MEMBERS = 40, 24, 8
TRIGGERS, TARGETS = (3, 4, 5), (6, 7, 8)


def dataset(samples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Padded token sequences and whether a trigger and a target token both occur."""
    tokens = rng.integers(9, VOCABULARY, size=(samples, LENGTH))
    label = rng.integers(0, 2, size=samples)
    for i in range(samples):
        length = rng.integers(8, LENGTH + 1)
        tokens[i, length:] = 0
        slots = rng.choice(length, size=2, replace=False)
        if label[i]:
            tokens[i, slots] = rng.choice(TRIGGERS), rng.choice(TARGETS)
        else:  # one of the two, or neither
            pool = TRIGGERS if rng.random() < 0.5 else TARGETS
            tokens[i, slots[0]] = rng.choice(pool) if rng.random() < 0.8 else 9
    noisy = rng.random(samples) < 0.05
    return tokens.astype("int32"), np.where(noisy, 1 - label, label)


def classifier(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, 32, mask_zero=True)(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16)(x, x)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attended]))
    h = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, keras.layers.Dense(32)(h)]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(2, activation="softmax")(x))


def main() -> None:
    samples, epochs = (256, 1) if QUICK else (6000, 8)
    rng = np.random.default_rng(3)
    x, y = dataset(samples, rng)
    x_test, y_test = dataset(samples // 4, rng)

    pack = kg.ModelPack.from_builder(classifier, n=MEMBERS)
    print(f"engine: {pack.engine}")
    print(pack.fusion_report)
    # Lion: on TensorFlow, Keras updates an Embedding's sparse gradient with Adam in a way the
    # fused engine cannot reproduce, so with Adam these members would train on the graph
    # engine (exactly, but slower); SGD and Lion fuse everywhere (docs/fusion.md, Limits).
    pack.compile(
        optimizer=keras.optimizers.Lion(3e-4),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    history = pack.fit(x, y, batch_size=64, epochs=epochs, validation_split=0.1, verbose=0)
    for epoch in range(epochs):
        accuracy = [history.history[f"val_m{i}_accuracy"][epoch] for i in range(MEMBERS)]
        low, high = min(accuracy), max(accuracy)
        print(f"epoch {epoch + 1}: members' validation accuracy {low:.3f} to {high:.3f}")

    probabilities = pack.predict(x_test, stack=True, verbose=0)  # (members, samples, 2)
    members = (probabilities.argmax(-1) == y_test).mean(axis=1)
    ensemble = (probabilities.mean(axis=0).argmax(-1) == y_test).mean()
    print(f"members' test accuracy: {members.min():.3f} to {members.max():.3f}")
    print(f"ensemble (mean of {MEMBERS}): {ensemble:.3f}")


if __name__ == "__main__":
    main()
