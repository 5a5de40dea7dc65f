"""keras-gpushare: make one GPU do the work of many in Keras 3."""

import logging

from keras_gpushare import callbacks
from keras_gpushare.devices import share_gpu
from keras_gpushare.pack import ModelPack
from keras_gpushare.pack.fusion import register_fused_layer
from keras_gpushare.placement import PlacedModel, Plan, split_model, stage

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "ModelPack",
    "PlacedModel",
    "Plan",
    "callbacks",
    "register_fused_layer",
    "share_gpu",
    "split_model",
    "stage",
]
