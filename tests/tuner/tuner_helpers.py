"""Hypermodels, data and a search script shared by the tuner tests."""

from __future__ import annotations

import json
import os
import signal

import keras
import numpy as np


def data(n: int = 128, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x[:, :2].sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def build_mlp(hp) -> keras.Model:
    """A tiny MLP; its weights depend only on the hyperparameters (seeded per trial)."""
    units = hp.Choice("units", [4, 8])
    lr = hp.Float("lr", 1e-3, 1e-1, sampling="log")
    keras.utils.set_random_seed(units)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(lr), loss="binary_crossentropy", metrics=["accuracy"]
    )
    return model


def build_sometimes_broken(hp) -> keras.Model:
    """Like `build_mlp`, but `units=8` raises in build and a huge learning rate diverges."""
    mode = hp.Choice("mode", ["ok", "raise", "diverge", "ok2"])
    if mode == "raise":
        raise ValueError("broken trial")
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    )
    lr = 1e9 if mode == "diverge" else 0.01
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model


def build_failing_from_2(hp) -> keras.Model:
    """A grid of `value` 1 to 5 where every value but 1 fails its build (`FailedTrialError`)."""
    from keras_tuner import errors

    value = hp.Int("value", 1, 5)
    if value >= 2:
        raise errors.FailedTrialError(f"wrong value {value}.")
    keras.utils.set_random_seed(value)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


class KillSelf(keras.callbacks.Callback):
    """SIGKILLs its own process at the end of epoch `epoch`, once (a marker file remembers)."""

    def __init__(self, marker: str, epoch: int = 0) -> None:
        super().__init__()
        self.marker = marker
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def trial_states(project_dir: str) -> dict:
    """trial id -> (status, score) read from the project's trial files."""
    states = {}
    for name in sorted(os.listdir(project_dir)):
        path = os.path.join(project_dir, name, "trial.json")
        if name.startswith("trial_") and os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            states[state["trial_id"]] = (state["status"], state["score"])
    return states


def oracle_state(project_dir: str) -> dict:
    with open(os.path.join(project_dir, "oracle.json")) as f:
        return json.load(f)


def build_wrong_input(hp) -> keras.Model:
    """`mode="bad"` builds a model for 7 features, so `fit` on the 6-feature data raises."""
    mode = hp.Choice("mode", ["ok", "bad", "ok2"])
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [keras.Input((7 if mode == "bad" else 6,)), keras.layers.Dense(4), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def script_env() -> dict:
    """The environment of a user's script run as a subprocess: it imports these helpers."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    return env


SEEN_ENV = "KG_TEST_SEEN_DIR"  # where `build_noting_device` notes what each build saw


def build_noting_device(hp) -> keras.Model:
    """`build_mlp`, noting the worker and the `CUDA_VISIBLE_DEVICES` each build saw.

    In a worker process (the search over `devices`), a build waits until two workers have
    built (for at most a minute), so that trials are split between them however fast one
    of them starts."""
    import time

    model = build_mlp(hp)
    folder = os.environ[SEEN_ENV]
    worker = os.environ.get("KERAS_GPUSHARE_TUNER_WORKER")
    note = {"worker": worker, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "lr": hp["lr"]}
    with open(os.path.join(folder, f"{os.getpid()}-{hp['lr']!r}.json"), "w") as f:
        json.dump(note, f)
    deadline = time.monotonic() + 60
    while worker and time.monotonic() < deadline:
        if len({seen(folder)[k]["worker"] for k in seen(folder)}) >= 2:
            break
        time.sleep(0.1)
    return model


def seen(folder: str) -> dict:
    """What `build_noting_device` noted, by file name."""
    notes = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            notes[name] = json.load(f)
    return notes
