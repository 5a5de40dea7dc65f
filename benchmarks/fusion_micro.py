"""Micro-benchmark of the fused engine: N MLPs (10-64-32-1, batch 32) per training step.

Times one forward + backward + optimizer update for N = 1, 16, 64 members, fused into
one `FusedModel` with a `VectorizedOptimizer`, against a loop over N separate Keras
models and optimizers inside one `tf.function`, in the same run, and prints the
ratios. TensorFlow backend.

    python benchmarks/fusion_micro.py [--sizes 1 16 64] [--steps 200] [--jit | --no-jit]
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_gpushare.pack.fusion import VectorizedOptimizer, build_fused_model  # noqa: E402

BATCH = 32


def build(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10,))
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def fused_step(members, jit):
    fused = build_fused_model(members)
    optimizer = VectorizedOptimizer([keras.optimizers.Adam(1e-3) for _ in members])
    optimizer.build(fused.trainable_variables)

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            per_member = tf.reduce_mean(tf.square(fused(x, training=True) - y), axis=[1, 2])
            loss = tf.reduce_sum(per_member)
        grads = tape.gradient(loss, fused.trainable_variables)
        optimizer.apply(grads, fused.trainable_variables)
        return loss

    return step


def loop_step(members, jit):
    optimizers = [keras.optimizers.Adam(1e-3) for _ in members]
    for member, optimizer in zip(members, optimizers):
        optimizer.build(member.trainable_variables)

    @tf.function(jit_compile=jit)
    def step(x, y):
        total = 0.0
        for member, optimizer in zip(members, optimizers):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(member(x, training=True) - y))
            grads = tape.gradient(loss, member.trainable_variables)
            optimizer.apply(grads, member.trainable_variables)
            total += loss
        return total

    return step


def seconds_per_step(step, x, y, steps):
    step(x, y)
    step(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(x, y)
    float(loss)
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--jit", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(BATCH, 10)).astype("float32"))
    y = tf.constant(rng.normal(size=(BATCH, 1)).astype("float32"))
    print(f"MLP 10-64-32-1, batch {BATCH}, Adam, jit_compile={args.jit}, {args.steps} steps")
    print(f"{'N':>4} {'fused ms':>9} {'loop ms':>9} {'fused model-samples/s':>22} {'speedup':>8}")
    for n in args.sizes:
        fused = fused_step([build(i) for i in range(n)], args.jit)
        fused = seconds_per_step(fused, x, y, args.steps)
        loop = loop_step([build(i) for i in range(n)], args.jit)
        loop = seconds_per_step(loop, x, y, max(10, args.steps // max(1, n // 4)))
        rate = n * BATCH / fused
        print(f"{n:>4} {fused * 1e3:>9.3f} {loop * 1e3:>9.3f} {rate:>22,.0f} {loop / fused:>7.1f}x")


if __name__ == "__main__":
    main()
