"""A search run as its own process by the tuner tests (resume and multi-machine tests).

Usage: python tuner_search_script.py DIRECTORY EXECUTOR MAX_TRIALS PARALLEL [KILL_POINT]

KILL_POINT makes the process SIGKILL itself at one moment of the search:
  fit         in the middle of the second round's training
  ended       after the third trial's file says COMPLETED, before the oracle's state is saved
  created     after trial 4's file is first written, before the oracle's state is saved
  mid-write   while writing the oracle's state for the 6th time (a half-written temporary file)
"""

import os
import signal
import sys

import keras
import tuner_helpers

import keras_gpushare as kg
from keras_gpushare.tuner import _state

_counts = {"completed": 0, "oracle": 0}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill_point(point: str) -> None:
    original = _state.write_json

    def write_json(path, obj):
        name = os.path.basename(path)
        if point == "mid-write" and name == "oracle.json":
            _counts["oracle"] += 1
            if _counts["oracle"] == 6:
                with open(os.path.join(os.path.dirname(path), ".tmp-partial.json"), "w") as f:
                    f.write('{"ongoing_tri')
                _die()
        text = original(path, obj)
        if name == "trial.json" and obj.get("status") == "COMPLETED":
            _counts["completed"] += 1
            if point == "ended" and _counts["completed"] == 3:
                _die()
        if point == "created" and name == "trial.json" and obj.get("trial_id") == "4":
            _die()
        return text

    _state.write_json = write_json


class _KillInSecondRound(keras.callbacks.Callback):
    def __init__(self, tuner):
        super().__init__()
        self.tuner = tuner

    def __deepcopy__(self, memo):
        return self

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and len(self.tuner.oracle.end_order) >= 2:
            _die()


def main() -> None:
    directory, executor, max_trials, parallel = sys.argv[1:5]
    point = sys.argv[5] if len(sys.argv) > 5 else ""
    if point and point != "fit":
        _install_kill_point(point)
    tuner = kg.tuner.ParallelTuner(
        tuner_helpers.build_mlp,
        objective="val_loss",
        max_trials=int(max_trials),
        parallel_trials=int(parallel),
        # "devices": one worker per (CPU) device, two of them.
        **({"devices": [0, 1]} if executor == "devices" else {"executor": executor}),
        seed=5,
        directory=directory,
        project_name="search",
    )
    callbacks = [_KillInSecondRound(tuner)] if point == "fit" else []
    x, y = tuner_helpers.data()
    tuner.search(x, y, epochs=3, validation_split=0.25, verbose=0, callbacks=callbacks)


if __name__ == "__main__":
    main()
