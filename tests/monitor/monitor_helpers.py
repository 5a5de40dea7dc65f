"""Helpers of the monitor tests: thread lookup and tiny Keras models."""

import threading

import numpy as np

THREAD_NAME = "keras-gpushare-monitor"


def monitor_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def join_monitor_threads():
    """Waits for monitor threads to end (bounded, generous) and returns those still alive."""
    for thread in monitor_threads():
        thread.join(30)
    return monitor_threads()


def tiny_model():
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def tiny_data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")
