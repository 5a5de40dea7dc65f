"""Split one model over two devices, the seeds' "model split training" redone with the plugin.

The seed put `Dense(128)` on /GPU:0 and `Dense(10)` on /GPU:1 with `tf.device` inside a
subclassed model; in Keras 3 that places the weights but runs the math, the backward and
the optimizer on the default device. Here each stage's forward, backward, weights,
optimizer slots and updates run on its device, and micro-batches pipeline the stages.
With no GPU, the CPU is carved into two logical CPUs so the same script runs anywhere.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_gpushare as kg  # noqa: E402

# First, before TensorFlow touches a device: two devices to place on (on one GPU, two
# logical GPUs of 4 GiB; without a GPU, two logical CPUs).
devices = kg.share_gpu(split=2, memory_limit_mb=4096)

import keras  # noqa: E402
import numpy as np  # noqa: E402

# MNIST-shaped random data, so the example needs no download (fewer rows in the test suite's
# quick run).
rows, epochs = (256, 1) if os.environ.get("KERAS_GPUSHARE_QUICK") == "1" else (2048, 2)
rng = np.random.default_rng(0)
x_train = rng.random((rows, 784), dtype=np.float32)
y_train = rng.integers(0, 10, rows)

inputs = keras.Input((784,))
with kg.stage(devices[0]):
    h = keras.layers.Dense(128, activation="relu")(inputs)
with kg.stage(devices[1]):
    outputs = keras.layers.Dense(10, activation="softmax")(h)
model = kg.PlacedModel(inputs, outputs, microbatches=4)
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
print(model.plan)
model.fit(x_train, y_train, epochs=epochs, batch_size=32, verbose=2)

# An existing model splits too: weights kept, stages balanced by parameter count.
seq = keras.Sequential(
    [keras.Input((784,))]
    + [keras.layers.Dense(256, activation="relu") for _ in range(4)]
    + [keras.layers.Dense(10, activation="softmax")]
)
placed = kg.split_model(seq, devices=devices[:2], balance="params", microbatches=4)
placed.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
print(placed.plan)
placed.fit(x_train, y_train, epochs=1, batch_size=64, verbose=2)
