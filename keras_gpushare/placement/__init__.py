"""Placement: split a Keras model into stages on several devices and pipeline micro-batches."""

from keras_gpushare.placement.builder import PlacedModel, stage
from keras_gpushare.placement.plan import Plan
from keras_gpushare.placement.split import split_model

__all__ = ["PlacedModel", "Plan", "split_model", "stage"]
