"""keras-gpushare: make one GPU do the work of many in Keras 3.

`ModelPack`, the callbacks and the fused engine work on every Keras backend. Placement
(`stage`, `PlacedModel`, `split_model`, `Plan`) and `share_gpu` are TensorFlow's: they are
imported with the package when Keras runs on TensorFlow, and on first use otherwise (where
they raise a clear ImportError if TensorFlow is missing). `tuner` (KerasTuner) is imported
on first use.
"""

import importlib
import logging

import keras

from keras_gpushare import callbacks
from keras_gpushare.autopack import find_pack_size
from keras_gpushare.pack import ModelPack
from keras_gpushare.pack.fusion import register_fused_layer, register_optimizer_rule
from keras_gpushare.workers import run_local_workers

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

_TENSORFLOW_ONLY = {
    "PlacedModel": "keras_gpushare.placement",
    "Plan": "keras_gpushare.placement",
    "split_model": "keras_gpushare.placement",
    "stage": "keras_gpushare.placement",
    "share_gpu": "keras_gpushare.devices",
}

__all__ = [
    "ModelPack",
    "PlacedModel",
    "Plan",
    "callbacks",
    "find_pack_size",
    "register_fused_layer",
    "register_optimizer_rule",
    "run_local_workers",
    "share_gpu",
    "split_model",
    "stage",
    "tuner",
]


def __getattr__(name: str) -> object:
    if name == "tuner":
        value = importlib.import_module("keras_gpushare.tuner")
    elif name in _TENSORFLOW_ONLY:
        value = getattr(importlib.import_module(_TENSORFLOW_ONLY[name]), name)
    else:
        raise AttributeError(f"module 'keras_gpushare' has no attribute {name!r}")
    globals()[name] = value
    return value


if keras.backend.backend() == "tensorflow":
    from keras_gpushare.devices import share_gpu
    from keras_gpushare.placement import PlacedModel, Plan, split_model, stage
