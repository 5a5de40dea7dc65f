"""Fused forms of Conv1D, Conv2D, their transposes, and DepthwiseConv2D."""

import logging

import keras
import numpy as np
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import has_accelerator
from keras_gpushare.pack.fusion import _padding
from keras_gpushare.pack.fusion import layout as layout_lib
from keras_gpushare.pack.fusion._checks import padded_activation_problem, unsupported_options
from keras_gpushare.pack.fusion._checks import regularizer as _regularizer
from keras_gpushare.pack.fusion.base import FusedLayer, fold
from keras_gpushare.pack.fusion.registry import register_fused_layer

logger = logging.getLogger(__name__)

_IMPLEMENTATIONS = ("auto", "patches", "grouped")


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedConv(FusedLayer):
    """N Conv1D or Conv2D layers computed together.

    Two formulations give the same result:

    - `"patches"`: the input's patches are extracted once (`ops.image.extract_patches`)
      and multiplied by the members' kernels in one batched matmul. On CPU this is far
      faster than grouped convolution under TensorFlow (XLA's CPU grouped convolution
      is slow) and needs no XLA. Member `groups` must be 1.
    - `"grouped"`: members' channels are laid side by side and one convolution runs with
      `groups * N` groups (HFTA's formulation), the fast path on GPUs.

    `"auto"` picks `"grouped"` when Keras sees an accelerator or the member uses
    `groups > 1`, and `"patches"` otherwise.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `Conv1D`/`Conv2D` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        implementation: `"auto"`, `"patches"` or `"grouped"`. Defaults to `"auto"`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_conv import FusedConv

    config = keras.layers.Conv2D(4, 3, padding="same").get_config()
    layer = FusedConv(n_members=2, member_config=config, input_stacked=False)
    print(layer(keras.ops.ones((3, 8, 8, 1))).shape)  # (2, 3, 8, 8, 4)
    ```
    """

    size_keys: tuple[str, ...] = ("filters",)
    per_member_keys: tuple[str, ...] = ("activation", "use_bias")
    regularizer_keys: tuple[str, ...] = ("kernel_regularizer", "bias_regularizer")
    skippable = True
    xla_pays_on_cpu = False

    def __init__(
        self,
        n_members,
        member_config,
        input_stacked=True,
        implementation="auto",
        **kwargs,
    ):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"Invalid value for argument `implementation`: got {implementation!r}. "
                f"Expected one of {_IMPLEMENTATIONS}."
            )
        self.implementation = implementation
        self.member_filters = [int(f or 0) for f in self.per_member("filters")]
        self.filters = max(self.member_filters)
        self.kernel_size = tuple(member_config["kernel_size"])
        self.rank = len(self.kernel_size)
        self.strides = tuple(member_config["strides"])
        self.dilation_rate = tuple(member_config["dilation_rate"])
        self.padding = member_config["padding"]
        self.groups = int(member_config.get("groups", 1))
        self.member_bias = [bool(b) for b in self.per_member("use_bias")]
        self.use_bias = any(self.member_bias)
        self.out_layout = layout_lib.prefix(self.member_filters, self.filters)

    @classmethod
    def unsupported_reason(cls, member_config):
        return unsupported_options(member_config)

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        filters = [0 if layer is None else int(layer.filters) for layer in layers]
        padded = len(set(filters)) > 1 or not layout_lib.is_full(input_layouts[0])
        if padded and any(layer is not None and layer.groups > 1 for layer in layers):
            return None, "grouped convolutions (`groups > 1`) of different widths do not fuse"
        layout = layout_lib.prefix(filters)
        reason = padded_activation_problem(layers, layout)
        return ([layout], None) if reason is None else (None, reason)

    def build(self, input_shape):
        channels = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.n_members, *self.kernel_size, channels // self.groups, self.filters),
            regularizer=_regularizer(self.member_config, "kernel_regularizer"),
        )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.n_members, self.filters),
                initializer="zeros",
                regularizer=_regularizer(self.member_config, "bias_regularizer"),
            )
        self._padding_masks(channels)

    def _padding_masks(self, channels):
        """The masks keeping the kernel's and bias's padding at zero (`None` without)."""
        in_layout = self.input_layout()
        if in_layout is None:
            in_layout = layout_lib.full(channels // self.groups, self.n_members)
        self._in_layout = in_layout
        mask = _padding.outer(in_layout, self.out_layout)
        spatial = (1,) * self.rank
        self.kernel_mask = _padding.mask_or_none(
            mask.reshape(self.n_members, *spatial, *mask.shape[1:])
        )
        bias_layout = self.out_layout & np.asarray(self.member_bias)[:, None]
        self.bias_mask = _padding.mask_or_none(bias_layout)

    def member_weight_index(self, k, i):
        padded = self.kernel_mask is not None
        rows = np.flatnonzero(self._in_layout[i])
        cols = np.flatnonzero(self.out_layout[i])
        if k == 0:
            return 0, ((None,) * self.rank + (rows, cols) if padded else None)
        if not self.member_bias[i]:
            return None, None
        return 1, ((cols,) if padded else None)

    def _resolved_implementation(self):
        if self.implementation != "auto":
            return self.implementation
        if self.groups > 1 or has_accelerator():
            return "grouped"
        return "patches"

    def _causal_pad(self, x):
        amount = self.dilation_rate[0] * (self.kernel_size[0] - 1)
        pads = [[0, 0]] * (len(x.shape) - 2) + [[amount, 0], [0, 0]]
        return ops.pad(x, pads)

    def call(self, inputs, training=None):
        stacked = self.input_is_stacked()
        x = inputs
        padding = self.padding
        if padding == "causal":
            x = self._causal_pad(x)
            padding = "valid"
        kernel = _padding.masked(self.kernel, self.kernel_mask)
        y = self._convolve(x, stacked, kernel, padding, self.strides, self.dilation_rate)
        if self.bias is not None:
            y = y + self.member_broadcast(_padding.masked(self.bias, self.bias_mask), len(y.shape))
        return self.activate(y)

    def _convolve(self, x, stacked, kernel, padding, strides, dilation):
        """Every member's convolution of `x` with its `(*kernel_size, C, filters)` kernel."""
        if self._resolved_implementation() == "grouped":
            return self._grouped(
                x if stacked else self.stack(x), kernel, padding, strides, dilation
            )
        return self._patches(x, stacked, kernel, padding, strides, dilation)

    def _patches(self, x, stacked, kernel, padding, strides, dilation):
        n, filters = self.n_members, self.filters
        images = fold(x) if stacked else x
        if self.rank == 1:
            images = ops.expand_dims(images, 1)
        size = (1, *self.kernel_size) if self.rank == 1 else self.kernel_size
        strides = (1, *strides) if self.rank == 1 else strides
        dilation = (1, *dilation) if self.rank == 1 else dilation
        patches = ops.image.extract_patches(
            images, size, strides=strides, dilation_rate=dilation, padding=padding
        )
        spatial = ops.shape(patches)[1:-1] if self.rank == 2 else ops.shape(patches)[2:-1]
        depth = patches.shape[-1]
        kernel = ops.reshape(kernel, (n, depth, filters))
        if stacked:
            y = ops.matmul(ops.reshape(patches, (n, -1, depth)), kernel)
            return ops.reshape(y, (n, -1, *spatial, filters))
        side_by_side = ops.reshape(ops.transpose(kernel, (1, 0, 2)), (depth, n * filters))
        y = ops.matmul(ops.reshape(patches, (-1, depth)), side_by_side)
        y = ops.transpose(ops.reshape(y, (-1, n, filters)), (1, 0, 2))
        return ops.reshape(y, (n, -1, *spatial, filters))

    def _grouped(self, x, kernel, padding, strides, dilation):
        n = self.n_members
        r = self.rank
        shape = ops.shape(x)
        # (N, B, *S, C) -> (B, *S, N * C): members' channels side by side.
        perm = (*range(1, r + 2), 0, r + 2)
        x = ops.reshape(ops.transpose(x, perm), (-1, *shape[2:-1], n * shape[-1]))
        # (N, *k, C/g, F) -> (*k, C/g, N * F).
        depth = kernel.shape[-2]
        kernel = ops.transpose(kernel, (*range(1, r + 2), 0, r + 2))
        kernel = ops.reshape(kernel, (*self.kernel_size, depth, n * self.filters))
        y = ops.conv(x, kernel, strides=strides, padding=padding, dilation_rate=dilation)
        out_shape = ops.shape(y)
        y = ops.reshape(y, (-1, *out_shape[1:-1], n, self.filters))
        return ops.transpose(y, (r + 1, 0, *range(1, r + 1), r + 2))

    def get_config(self):
        config = super().get_config()
        config["implementation"] = self.implementation
        return config


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedConvTranspose(FusedConv):
    """N Conv1DTranspose or Conv2DTranspose layers computed together.

    A transposed convolution is a convolution of the input with zeros inserted between
    its elements (`strides - 1` of them), padded as Keras pads (the amounts Keras's JAX
    backend computes for `padding` and `output_padding`), with the kernel flipped and its
    two channel axes swapped. That convolution runs fused as in `FusedConv` (patches and
    one batched matmul on CPU, grouped convolution on accelerators).

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `Conv1DTranspose`/`Conv2DTranspose` config. Defaults
            to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        implementation: `"auto"`, `"patches"` or `"grouped"`. Defaults to `"auto"`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_conv import FusedConvTranspose

    config = keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same").get_config()
    layer = FusedConvTranspose(n_members=2, member_config=config, input_stacked=False)
    print(layer(keras.ops.ones((3, 5, 5, 1))).shape)  # (2, 3, 10, 10, 4)
    ```
    """

    size_keys = ()
    per_member_keys = ()
    skippable = False
    xla_pays_on_cpu = True

    def __init__(
        self, n_members, member_config, input_stacked=True, implementation="auto", **kwargs
    ):
        super().__init__(n_members, member_config, input_stacked, implementation, **kwargs)
        output_padding = member_config.get("output_padding")
        if isinstance(output_padding, int):
            output_padding = (output_padding,) * self.rank
        self.output_padding = None if output_padding is None else tuple(output_padding)

    def build(self, input_shape):
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.n_members, *self.kernel_size, self.filters, input_shape[-1]),
            regularizer=_regularizer(self.member_config, "kernel_regularizer"),
        )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.n_members, self.filters),
                initializer="zeros",
                regularizer=_regularizer(self.member_config, "bias_regularizer"),
            )

    def call(self, inputs, training=None):
        stacked = self.input_is_stacked()
        first = 2 if stacked else 1
        x = inputs
        pads = _upstream.conv_transpose_padding_args(
            input_shape=(None, *([None] * self.rank), None),
            kernel_shape=(*self.kernel_size, self.filters, None),
            strides=self.strides,
            padding=self.padding,
            output_padding=self.output_padding,
            dilation_rate=self.dilation_rate,
        )
        for i, stride in enumerate(self.strides):
            x = _insert_zeros(x, first + i, stride)
        lead = [[0, 0]] * first
        x = ops.pad(x, [*lead, *[list(p) for p in pads], [0, 0]])
        # (N, *k, filters, C): flip the window and swap the channel axes.
        r = self.rank
        kernel = ops.flip(self.kernel, axis=tuple(range(1, r + 1)))
        kernel = ops.transpose(kernel, (*range(r + 1), r + 2, r + 1))
        y = self._convolve(x, stacked, kernel, "valid", (1,) * r, self.dilation_rate)
        if self.bias is not None:
            y = y + self.member_broadcast(self.bias, len(y.shape))
        return self.activate(y)

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        return FusedLayer.output_layouts.__func__(cls, layers, input_layouts, input_shapes)

    def member_weight_index(self, k, i):
        return k, None


def _insert_zeros(x, axis, stride):
    """`stride - 1` zeros between the elements of `x` along `axis`."""
    if stride == 1:
        return x
    shape = ops.shape(x)
    length = shape[axis]
    x = ops.expand_dims(x, axis + 1)
    pads = [[0, 0]] * len(x.shape)
    pads[axis + 1] = [0, stride - 1]
    x = ops.pad(x, pads)
    x = ops.reshape(x, (*shape[:axis], length * stride, *shape[axis + 1 :]))
    keep = [slice(None)] * len(x.shape)
    keep[axis] = slice(0, (length - 1) * stride + 1)
    return x[tuple(keep)]


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedDepthwiseConv2D(FusedLayer):
    """N DepthwiseConv2D layers as one depthwise convolution over `N * C` channels.

    A depthwise convolution already treats every channel on its own, so laying the
    members' channels side by side computes all members exactly, with no grouping.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `DepthwiseConv2D` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_conv import FusedDepthwiseConv2D

    config = keras.layers.DepthwiseConv2D(3, padding="same").get_config()
    layer = FusedDepthwiseConv2D(n_members=2, member_config=config, input_stacked=False)
    print(layer(keras.ops.ones((3, 8, 8, 4))).shape)  # (2, 3, 8, 8, 4)
    ```
    """

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.kernel_size = tuple(member_config["kernel_size"])
        self.strides = tuple(member_config["strides"])
        self.dilation_rate = tuple(member_config["dilation_rate"])
        self.padding = member_config["padding"]
        self.depth_multiplier = int(member_config["depth_multiplier"])
        self.member_bias = [bool(b) for b in self.per_member("use_bias")]
        self.use_bias = any(self.member_bias)

    per_member_keys = ("activation", "use_bias")
    regularizer_keys = ("depthwise_regularizer", "bias_regularizer")
    xla_pays_on_cpu = False

    @classmethod
    def unsupported_reason(cls, member_config):
        return unsupported_options(member_config)

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        if layout_lib.is_full(input_layouts[0]):
            return [None], None
        multiplier = next(layer for layer in layers if layer is not None).depth_multiplier
        full = layout_lib.full(multiplier, len(layers))
        layout = layout_lib.product(input_layouts[0], full)
        reason = padded_activation_problem(layers, layout)
        return ([layout], None) if reason is None else (None, reason)

    def member_weight_index(self, k, i):
        if self.kernel_mask is None:
            return (k, None) if k == 0 or self.member_bias[i] else (None, None)
        channels = np.flatnonzero(self._in_layout[i])
        if k == 0:
            return 0, (None, None, channels, None)
        if not self.member_bias[i]:
            return None, None
        return 1, (np.flatnonzero(self._out_layout[i]),)

    def build(self, input_shape):
        channels = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.n_members, *self.kernel_size, channels, self.depth_multiplier),
            regularizer=_regularizer(self.member_config, "depthwise_regularizer"),
        )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.n_members, channels * self.depth_multiplier),
                initializer="zeros",
                regularizer=_regularizer(self.member_config, "bias_regularizer"),
            )
        in_layout = self.input_layout()
        self._in_layout = (
            layout_lib.full(channels, self.n_members) if in_layout is None else in_layout
        )
        multiplier = layout_lib.full(self.depth_multiplier, self.n_members)
        self._out_layout = layout_lib.product(self._in_layout, multiplier)
        self.kernel_mask = _padding.mask_or_none(
            np.broadcast_to(
                self._in_layout[:, None, None, :, None],
                (self.n_members, 1, 1, channels, self.depth_multiplier),
            )
        )
        self.bias_mask = _padding.mask_or_none(
            self._out_layout & np.asarray(self.member_bias)[:, None]
        )

    def call(self, inputs, training=None):
        n = self.n_members
        x = self.to_stacked(inputs)
        shape = ops.shape(x)
        channels = x.shape[-1]
        x = ops.reshape(ops.transpose(x, (1, 2, 3, 0, 4)), (-1, shape[2], shape[3], n * channels))
        kernel = ops.transpose(_padding.masked(self.kernel, self.kernel_mask), (1, 2, 0, 3, 4))
        kernel = ops.reshape(kernel, (*self.kernel_size, n * channels, self.depth_multiplier))
        y = ops.depthwise_conv(
            x,
            kernel,
            strides=self.strides,
            padding=self.padding,
            dilation_rate=self.dilation_rate,
        )
        out_shape = ops.shape(y)
        y = ops.reshape(y, (-1, out_shape[1], out_shape[2], n, channels * self.depth_multiplier))
        y = ops.transpose(y, (3, 0, 1, 2, 4))
        if self.bias is not None:
            y = y + self.member_broadcast(_padding.masked(self.bias, self.bias_mask), 5)
        return self.activate(y)


register_fused_layer(keras.layers.Conv2D)(FusedConv)
register_fused_layer(keras.layers.Conv1D)(FusedConv)
register_fused_layer(keras.layers.Conv2DTranspose)(FusedConvTranspose)
register_fused_layer(keras.layers.Conv1DTranspose)(FusedConvTranspose)
register_fused_layer(keras.layers.DepthwiseConv2D)(FusedDepthwiseConv2D)
