"""Layers the fuser does not know, for tests of members that train on the graph engine."""

import keras


class Scale(keras.layers.Layer):
    """A per-feature scale the fuser does not know: its members train on the graph engine."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.scale
