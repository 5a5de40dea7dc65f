"""ModelPack: N Keras models trained concurrently inside one `model.fit`."""

from keras_gpushare.pack.model import ModelPack

__all__ = ["ModelPack"]
