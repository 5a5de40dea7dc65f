"""Keras callbacks of keras-gpushare, importable as `keras_gpushare.callbacks`."""

__all__ = []
