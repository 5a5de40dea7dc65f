"""Keras callbacks of keras-gpushare, importable as `keras_gpushare.callbacks`."""

from keras_gpushare.monitor.callback import UtilizationLogger
from keras_gpushare.pack._loop._early_stopping import MemberEarlyStopping

__all__ = ["MemberEarlyStopping", "UtilizationLogger"]
