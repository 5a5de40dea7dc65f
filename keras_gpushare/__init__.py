"""keras-gpushare: make one GPU do the work of many in Keras 3."""

import logging

from keras_gpushare import callbacks
from keras_gpushare.pack import ModelPack

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = ["ModelPack", "callbacks"]
