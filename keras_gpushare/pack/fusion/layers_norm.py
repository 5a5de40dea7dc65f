"""Fused forms of BatchNormalization and LayerNormalization."""

import keras
import numpy as np
from keras import ops

from keras_gpushare.pack.fusion import _padding
from keras_gpushare.pack.fusion import layout as layout_lib
from keras_gpushare.pack.fusion._checks import regularizer as _regularizer
from keras_gpushare.pack.fusion._checks import unsupported_options
from keras_gpushare.pack.fusion.base import FusedLayer
from keras_gpushare.pack.fusion.registry import register_fused_layer


class _FusedNormalization(FusedLayer):
    """Shared axis bookkeeping: member axes shift by one on the stacked tensor.

    Members whose features (the last axis, normalized) are padded to the widest member
    scale and shift only their own features: the padding's scale and offset are masked to
    zero, so the padded outputs stay zero.
    """

    regularizer_keys = ("gamma_regularizer", "beta_regularizer")
    passes_layout = True
    skippable = True

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        if layout_lib.is_full(input_layouts[0]):
            return [None], None
        rank = len(input_shapes[0])
        for layer in layers:
            axis = None if layer is None else layer.get_config().get("axis", -1)
            axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
            if layer is not None and [a % rank for a in axes] != [rank - 1]:
                return None, "normalizing other axes than the features of different widths"
        return [input_layouts[0]], None

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        axis = member_config.get("axis", -1)
        self.member_axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
        self.epsilon = float(member_config.get("epsilon", 1e-3))
        self.center = member_config.get("center", True)
        self.scale = member_config.get("scale", True)

    def _build_axes(self, input_shape):
        member_rank = len(input_shape) - (1 if self.input_is_stacked() else 0)
        self.stacked_axes = sorted(a % member_rank + 1 for a in self.member_axes)
        self.stacked_rank = member_rank + 1
        offset = self.stacked_rank - len(input_shape)
        self.param_shape = tuple(input_shape[a - offset] for a in self.stacked_axes)
        self.broadcast_shape = [self.n_members] + [
            input_shape[a - offset] if a in self.stacked_axes else 1
            for a in range(1, self.stacked_rank)
        ]
        self.feature_layout = self.input_layout()
        self.param_mask = None
        if self.feature_layout is not None:
            self.param_mask = _padding.mask_or_none(self.feature_layout)

    def member_weight_index(self, k, i):
        if self.param_mask is None:
            return k, None
        return k, (np.flatnonzero(self.feature_layout[i]),)

    def _add_pair(self):
        self.gamma = self.beta = None
        shape = (self.n_members, *self.param_shape)
        if self.scale:
            self.gamma = self.add_weight(
                name="gamma",
                shape=shape,
                initializer="ones",
                regularizer=_regularizer(self.member_config, "gamma_regularizer"),
            )
        if self.center:
            self.beta = self.add_weight(
                name="beta",
                shape=shape,
                initializer="zeros",
                regularizer=_regularizer(self.member_config, "beta_regularizer"),
            )

    def _normalize(self, x, mean, variance):
        inv = ops.rsqrt(variance + self.epsilon)
        if self.gamma is not None:
            gamma = _padding.masked(self.gamma, self.param_mask)
            inv = inv * ops.reshape(ops.cast(gamma, x.dtype), self.broadcast_shape)
        elif self.param_mask is not None:
            inv = inv * ops.reshape(ops.cast(self.param_mask, x.dtype), self.broadcast_shape)
        res = -mean * inv
        if self.beta is not None:
            beta = _padding.masked(self.beta, self.param_mask)
            res = res + ops.reshape(ops.cast(beta, x.dtype), self.broadcast_shape)
        return x * inv + res


@register_fused_layer(keras.layers.BatchNormalization)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedBatchNormalization(_FusedNormalization):
    """N BatchNormalization layers, each with its own batch and moving statistics.

    Batch moments are taken over every axis but the member axis and the normalized
    axes, so each member normalizes with its own statistics and updates its own
    moving mean and variance, as HFTA's fused batch norm does.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `BatchNormalization` config. Defaults to none
            (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_norm import FusedBatchNormalization

    config = keras.layers.BatchNormalization().get_config()
    layer = FusedBatchNormalization(n_members=2, member_config=config)
    print(layer(keras.ops.ones((2, 3, 4)), training=True).shape)  # (2, 3, 4)
    ```
    """

    member_state = ("moving_mean", "moving_variance")

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.momentum = float(member_config.get("momentum", 0.99))

    @classmethod
    def unsupported_reason(cls, member_config):
        if member_config.get("renorm"):
            return "option `renorm=True` is not supported by the fused form"
        return unsupported_options(member_config)

    def build(self, input_shape):
        self._build_axes(input_shape)
        self._add_pair()
        shape = (self.n_members, *self.param_shape)
        self.moving_mean = self.add_weight(
            name="moving_mean", shape=shape, initializer="zeros", trainable=False
        )
        self.moving_variance = self.add_weight(
            name="moving_variance", shape=shape, initializer="ones", trainable=False
        )

    def call(self, inputs, training=None):
        x = self.to_stacked(inputs)
        compute_dtype = keras.backend.result_type(x.dtype, "float32")
        x = ops.cast(x, compute_dtype)
        if training and self.trainable:
            reduction = [a for a in range(1, self.stacked_rank) if a not in self.stacked_axes]
            mean, variance = ops.moments(x, axes=reduction, keepdims=True)
            shape = (self.n_members, *self.param_shape)
            momentum = self.momentum
            self.moving_mean.assign(
                ops.cast(self.moving_mean, x.dtype) * momentum
                + ops.reshape(mean, shape) * (1.0 - momentum)
            )
            self.moving_variance.assign(
                ops.cast(self.moving_variance, x.dtype) * momentum
                + ops.reshape(variance, shape) * (1.0 - momentum)
            )
        else:
            mean = ops.reshape(ops.cast(self.moving_mean, x.dtype), self.broadcast_shape)
            variance = ops.reshape(ops.cast(self.moving_variance, x.dtype), self.broadcast_shape)
        return ops.cast(self._normalize(x, mean, variance), self.compute_dtype)


@register_fused_layer(keras.layers.LayerNormalization)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedLayerNormalization(_FusedNormalization):
    """N LayerNormalization layers: per-sample statistics, per-member scale and offset.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `LayerNormalization` config. Defaults to none
            (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_norm import FusedLayerNormalization

    config = keras.layers.LayerNormalization().get_config()
    layer = FusedLayerNormalization(n_members=2, member_config=config)
    print(layer(keras.ops.ones((2, 3, 4))).shape)  # (2, 3, 4)
    ```
    """

    handles_masks = True

    @classmethod
    def unsupported_reason(cls, member_config):
        if member_config.get("rms_scaling"):
            return "option `rms_scaling=True` (deprecated in Keras) is not supported"
        return unsupported_options(member_config)

    def build(self, input_shape):
        self._build_axes(input_shape)
        self._add_pair()

    def call(self, inputs, training=None):
        x = self.to_stacked(inputs)
        compute_dtype = keras.backend.result_type(x.dtype, "float32")
        x = ops.cast(x, compute_dtype)
        if self.param_mask is None:
            mean, variance = ops.moments(x, axes=self.stacked_axes, keepdims=True)
        else:
            # Each member's statistics over its own features only.
            mask = ops.reshape(ops.cast(self.param_mask, x.dtype), self.broadcast_shape)
            count = ops.maximum(ops.sum(mask, axis=-1, keepdims=True), 1.0)
            mean = ops.sum(x * mask, axis=-1, keepdims=True) / count
            variance = ops.sum(ops.square((x - mean) * mask), axis=-1, keepdims=True) / count
        return ops.cast(self._normalize(x, mean, variance), self.compute_dtype)

    def compute_mask(self, inputs, mask=None):
        return self.stacked_mask(mask)
