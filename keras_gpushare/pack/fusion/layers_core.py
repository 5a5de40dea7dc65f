"""Fused forms of Dense, Embedding, Dropout and of layers without weights."""

import keras
import numpy as np
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack.fusion import _padding
from keras_gpushare.pack.fusion import layout as layout_lib
from keras_gpushare.pack.fusion import settings as settings_lib
from keras_gpushare.pack.fusion._checks import padded_activation_problem, unsupported_options
from keras_gpushare.pack.fusion._checks import regularizer as _regularizer
from keras_gpushare.pack.fusion.base import FusedLayer, fold, unfold
from keras_gpushare.pack.fusion.cost import computes_every_member
from keras_gpushare.pack.fusion.registry import register_fused_layer

# Rows of a batch assumed when choosing how to mask padding while the batch size is unknown.
ASSUMED_ROWS = 64


@register_fused_layer(keras.layers.Dense)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedDense(FusedLayer):
    """N Dense layers as one batched matmul `(N, B, in) x (N, in, out)`.

    A replicated `(B, in)` input is multiplied once by the members' kernels laid side
    by side, `(B, in) x (in, N * out)`, so the batch is never copied N times. Members may
    differ in `units` (the kernel is as wide as the widest; each member's kernel is a
    masked corner of its slice), in `activation` and in `use_bias`.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `Dense` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_core import FusedDense

    config = keras.layers.Dense(3, activation="relu").get_config()
    layer = FusedDense(n_members=4, member_config=config, input_stacked=False)
    print(layer(keras.ops.ones((2, 5))).shape)  # (4, 2, 3)
    ```
    """

    handles_masks = True
    size_keys = ("units",)
    per_member_keys = ("activation", "use_bias")
    regularizer_keys = ("kernel_regularizer", "bias_regularizer")
    slot_keys = ("units", "activation", "use_bias")
    skippable = True
    computes_present_only = True
    # Built for slots, a searched Dense of a chain holds the template's widest width and
    # every activation of its searched Dense calls (`_capacity.template_capacity`).
    template_capacity = True

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.member_units = [int(u or 0) for u in self.per_member("units")]
        # Members that leave the layer out (a depth search's shallower ones) have no units.
        self.present = [i for i, u in enumerate(self.member_units) if u]
        if self.settings.held:
            # Which members skip the layer is data (`FusedSkip.slot_present`).
            self.present = list(range(self.n_members))
        capacity = self.member_config.get("slot_capacity", {}) if self.settings.held else {}
        self.units = max(*self.member_units, capacity.get("units", 0))
        self.member_bias = [bool(b) for b in self.per_member("use_bias")]
        # Built for slots, every member may have a bias: a member loaded later may use one.
        self.use_bias = any(self.member_bias) or self.settings.held
        self.out_layout = layout_lib.prefix(self.member_units, self.units)
        specs = [spec for spec in self.per_member("activation") if spec is not None]
        specs += capacity.get("activation", [])
        self.activation_specs = list({repr(spec): spec for spec in specs}.values())

    @classmethod
    def unsupported_reason(cls, member_config):
        return unsupported_options(member_config)

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        units = [0 if layer is None else int(layer.units) for layer in layers]
        layout = layout_lib.prefix(units)
        reason = padded_activation_problem(layers, layout)
        return ([layout], None) if reason is None else (None, reason)

    def build(self, input_shape):
        in_dim = input_shape[-1]
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.n_members, in_dim, self.units),
            regularizer=_regularizer(self.member_config, "kernel_regularizer"),
        )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.n_members, self.units),
                initializer="zeros",
                regularizer=_regularizer(self.member_config, "bias_regularizer"),
            )
        in_layout = self.input_layout()
        if in_layout is None:
            in_layout = layout_lib.full(in_dim, self.n_members)
        in_units = in_layout.sum(axis=1)
        if self.settings.held and np.array_equal(in_layout, layout_lib.prefix(in_units, in_dim)):
            self.features = _HeldFeatures(self, in_units)
        else:
            if self.settings.held:
                # Features padded other than as a prefix (after a padded convolution, say):
                # where each member's features lie is a constant of the step.
                self.settings = settings_lib.CONSTANTS
                self.member_config.pop("settings")
            self.features = _ConstantFeatures(self, in_layout)

    def member_weight_index(self, k, i):
        if k > 1:
            return None, None
        rows, cols, bias = self.features.member_parts(i)
        padded = self.features.padded
        if k == 0:
            return 0, ((rows, cols) if padded else None)
        if not bias:
            return None, None
        return 1, ((cols,) if padded else None)

    def slot_problem(self, layer):
        in_width, width = layer.kernel.shape
        if width > self.units or in_width > self.kernel.shape[1]:
            return (
                f"its layer `{layer.name}` has a ({in_width}, {width}) kernel where the "
                f"slot's holds at most ({self.kernel.shape[1]}, {self.units})"
            )
        spec = layer.get_config()["activation"]
        if repr(spec) not in [repr(s) for s in self.activation_specs]:
            return (
                f"its layer `{layer.name}` uses the activation {spec!r}; the slot's layer "
                f"computes {[s for s in self.activation_specs]}"
            )
        return padded_activation_problem([layer], layout_lib.prefix([width], self.units))

    def load_member(self, j, layer):
        in_width, width = layer.kernel.shape
        kernel = np.array(ops.convert_to_numpy(self.kernel))
        kernel[j] = 0.0
        kernel[j, :in_width, :width] = ops.convert_to_numpy(layer.kernel)
        self.kernel.assign(kernel)
        bias = np.array(ops.convert_to_numpy(self.bias))
        bias[j] = 0.0
        if layer.use_bias:
            bias[j, :width] = ops.convert_to_numpy(layer.bias)
        self.bias.assign(bias)
        self.features.load(j, layer)

    def clear_member(self, j):
        """Zeroes slot `j`'s kernel and bias and width: a skipped layer takes no step."""
        for variable in (self.kernel, self.bias, self.features.units):
            _set_row(variable, j, 0)

    def call(self, inputs, training=None):
        n, units = self.n_members, self.units
        in_dim = self.kernel.shape[1]
        stacked = self.input_is_stacked()
        lead = ops.shape(inputs)[1:-1] if stacked else ops.shape(inputs)[:-1]
        features = self.features
        masks_activations = features.padded and self._masks_activations(inputs)
        kernel = self.kernel
        if features.padded and not masks_activations:
            kernel = kernel * features.kernel_mask(kernel.dtype)
        if stacked:
            x = ops.reshape(inputs, (n, -1, in_dim))
            if masks_activations and features.input_padded():
                x = x * features.in_mask(x.dtype)
            if self._present_only(inputs):
                y = self._present_only_matmul(x, kernel)
            else:
                y = ops.matmul(x, kernel)
        else:
            x = ops.reshape(inputs, (-1, in_dim))
            if BACKEND.broadcast_batched_matmul:
                # A broadcast batched matmul reads the stacked kernel as it lies; the
                # side-by-side form below would copy (transpose) the kernel every step.
                y = ops.matmul(ops.expand_dims(x, 0), kernel)
            else:
                side_by_side = ops.reshape(ops.transpose(kernel, (1, 0, 2)), (in_dim, n * units))
                y = ops.transpose(
                    ops.reshape(ops.matmul(x, side_by_side), (-1, n, units)), (1, 0, 2)
                )
        if masks_activations:
            y = y * features.out_mask(y.dtype)
        y = ops.reshape(y, (n, *lead, units))
        if self.bias is not None:
            y = y + self.member_broadcast(features.bias(self.bias), len(y.shape))
        return features.activate(y)

    def _masks_activations(self, inputs):
        """Whether padding is kept at zero by masking activations rather than the kernel.

        Either keeps every padded weight's gradient exactly zero: masking the kernel
        zeroes its padded entries in the product; masking the input's padded features and
        the output's padded columns gives those entries a zero input and a zero output
        gradient. The cheaper one is taken, by the elements each multiplies (rows of the
        batch assumed `ASSUMED_ROWS` when the batch size is not known while tracing).
        """
        in_dim = self.kernel.shape[1]
        padded_in = in_dim if self.features.input_padded() else 0
        return self._rows(inputs) * (padded_in + self.units) < in_dim * self.units

    def _rows(self, inputs):
        """Rows of each member's product: the batch times its positions, `ASSUMED_ROWS`
        when the batch size is not known while tracing."""
        shape = inputs.shape[1:-1] if self.input_is_stacked() else inputs.shape[:-1]
        known = all(isinstance(d, (int, np.integer)) for d in shape)
        return int(np.prod(shape, dtype=int)) if known else ASSUMED_ROWS

    def _present_only(self, inputs):
        """Whether the product is computed for the members that have the layer only: where
        some leave it out and their product would cost more than the slicing and padding
        it saves (`cost.computes_every_member`, on `_rows`). Otherwise every member's
        product is computed, and `FusedSkip` passes the others' input on: their rows get
        no gradient either way."""
        absent = self.n_members - len(self.present)
        if not absent:
            return False
        in_dim = self.kernel.shape[1]
        return not computes_every_member(absent, self._rows(inputs), in_dim, self.units)

    def _present_only_matmul(self, x, kernel):
        """`x @ kernel` for the members that have this layer, zeros for the others.

        The members that leave it out take their input past it (`FusedSkip`), so their
        product would be discarded: taking only the others' slices saves its FLOPs.
        """
        present = np.asarray(self.present, "int32")
        y = ops.matmul(_members(x, present), _members(kernel, present))
        first, last = int(present[0]), int(present[-1])
        if last - first + 1 == len(present):
            # One run of members (the planner orders members by the layers they have):
            # zeros around it, whose gradient is a slice rather than a scatter.
            after = self.n_members - last - 1
            return ops.pad(y, [(first, after)] + [(0, 0)] * (len(y.shape) - 1))
        positions = np.full((self.n_members,), len(self.present), "int32")
        positions[present] = np.arange(len(self.present), dtype="int32")
        y = ops.concatenate([y, ops.zeros_like(y[:1])], axis=0)
        return ops.take(y, positions, axis=0)

    def compute_mask(self, inputs, mask=None):
        return self.stacked_mask(mask)


class _ConstantFeatures:
    """Where each member's features lie in a `FusedDense`, whether it has a bias and its
    activation, as constants of the step (`settings.CONSTANTS`): NumPy layouts, and no
    mask at all where no member is padded.

    Args:
        layer: the fused layer.
        in_layout: the input features each member owns, `(N, in)` bool.
    """

    def __init__(self, layer, in_layout):
        self._layer = layer
        self._in_layout = in_layout
        self._out_layout = layer.out_layout
        self._member_bias = layer.member_bias
        self._kernel_mask = _padding.mask_or_none(_padding.outer(in_layout, layer.out_layout))
        bias_layout = layer.out_layout & np.asarray(layer.member_bias)[:, None]
        self._bias_mask = _padding.mask_or_none(bias_layout)
        # Whether some member's kernel is padded: the product is then masked.
        self.padded = self._kernel_mask is not None

    def member_parts(self, i):
        """Member `i`'s input and output features, and whether it has a bias."""
        rows = np.flatnonzero(self._in_layout[i])
        cols = np.flatnonzero(self._out_layout[i])
        return rows, cols, self._member_bias[i]

    def input_padded(self):
        """Whether some member owns fewer input features than the kernel holds."""
        return not layout_lib.is_full(self._in_layout)

    def in_mask(self, dtype):
        """`(N, 1, in)`: ones where a member owns the input feature."""
        return _layout_mask(self._in_layout, dtype)

    def out_mask(self, dtype):
        """`(N, 1, units)`: ones where a member owns the output feature."""
        return _layout_mask(self._out_layout, dtype)

    def kernel_mask(self, dtype):
        """`(N, in, units)`: ones where a member owns the kernel entry."""
        return ops.convert_to_tensor(self._kernel_mask.astype("float32"), dtype=dtype)

    def bias(self, bias):
        """`bias` with each member's padding, and the bias of members without one, zeroed."""
        return _padding.masked(bias, self._bias_mask)

    def activate(self, y):
        """`y` through each member's own activation."""
        return self._layer.activate(y)


class _HeldFeatures:
    """Where each member's features lie in a `FusedDense`, whether it has a bias and its
    activation, held as data (`settings.HELD`): per-member variables of the step, a prefix
    of each width, that `load` sets for another member.

    Args:
        layer: the fused layer, which makes the variables.
        in_units: each member's input width.
    """

    padded = True

    def __init__(self, layer, in_units):
        self._layer = layer
        specs = [repr(spec) for spec in layer.activation_specs]
        own = [repr(spec) for spec in layer.per_member("activation")]
        self.in_units = layer.add_slot_variable("slot_in_units", in_units, "int32")
        self.units = layer.add_slot_variable("slot_units", layer.member_units, "int32")
        self.activation = layer.add_slot_variable(
            "slot_activation", [specs.index(a) if a in specs else 0 for a in own], "int32"
        )
        self.has_bias = layer.add_slot_variable("slot_bias", layer.member_bias, "float32")

    def member_parts(self, i):
        in_units = int(ops.convert_to_numpy(self.in_units)[i])
        units = int(ops.convert_to_numpy(self.units)[i])
        bias = bool(ops.convert_to_numpy(self.has_bias)[i])
        return np.arange(in_units), np.arange(units), bias

    def input_padded(self):
        # A replicated input is every member's whole input.
        return self._layer.input_is_stacked()

    def in_mask(self, dtype):
        return _prefix_mask(self.in_units, self._layer.kernel.shape[1], dtype)

    def out_mask(self, dtype):
        return _prefix_mask(self.units, self._layer.units, dtype)

    def kernel_mask(self, dtype):
        return ops.transpose(self.in_mask(dtype), (0, 2, 1)) * self.out_mask(dtype)

    def bias(self, bias):
        has_bias = ops.expand_dims(ops.cast(self.has_bias, bias.dtype), 1)
        return bias * self.out_mask(bias.dtype)[:, 0, :] * has_bias

    def activate(self, y):
        """`y` through each member's activation, chosen by its held index: every activation
        the layer computes is applied, and each member's selected."""
        specs = self._layer.activation_specs
        result = keras.activations.get(specs[-1])(y)
        if len(specs) == 1:
            return result
        index = self._layer.member_broadcast(self.activation, len(y.shape))
        for c, spec in enumerate(specs[:-1]):
            result = ops.where(ops.equal(index, c), keras.activations.get(spec)(y), result)
        return result

    def load(self, j, layer):
        """Slot `j` takes `layer`'s widths, activation and bias."""
        in_width, width = layer.kernel.shape
        specs = [repr(s) for s in self._layer.activation_specs]
        for variable, value in (
            (self.in_units, in_width),
            (self.units, width),
            (self.activation, specs.index(repr(layer.get_config()["activation"]))),
            (self.has_bias, float(layer.use_bias)),
        ):
            _set_row(variable, j, value)


def _layout_mask(layout, dtype):
    """`(N, 1, width)`: ones where a member owns the feature, zeros in its padding."""
    return ops.convert_to_tensor(layout[:, None, :].astype("float32"), dtype=dtype)


def _prefix_mask(widths, size, dtype):
    """`(N, 1, size)`: ones on the first `widths[i]` features of member `i`."""
    positions = ops.expand_dims(ops.arange(size, dtype="int32"), 0)
    owned = ops.less(positions, ops.expand_dims(ops.convert_to_tensor(widths), 1))
    return ops.expand_dims(ops.cast(owned, dtype), 1)


def _set_row(variable, row, value):
    """Assigns `value` to row `row` of `variable`, leaving the other rows."""
    values = np.array(ops.convert_to_numpy(variable))
    values[row] = value
    variable.assign(values)


def _members(tensor, ids):
    """Slices `ids` (increasing) of `tensor`'s member axis, joined.

    Static slices rather than a gather: a gather's gradient is sparse (`IndexedSlices` on
    TensorFlow), which the vectorized optimizer's per-member arithmetic cannot slice.
    """
    starts = [0, *np.flatnonzero(np.diff(ids) != 1) + 1]
    ends = [*starts[1:], len(ids)]
    pieces = [tensor[int(ids[a]) : int(ids[b - 1]) + 1] for a, b in zip(starts, ends)]
    return pieces[0] if len(pieces) == 1 else ops.concatenate(pieces, axis=0)


@register_fused_layer(keras.layers.Embedding)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedEmbedding(FusedLayer):
    """N embedding tables looked up at once.

    A replicated `(B, T)` index batch gathers from the `(N, V, D)` table along its
    vocabulary axis; a stacked `(N, B, T)` batch is offset by `n * V` into the
    flattened `(N * V, D)` table, so both are one gather. With `mask_zero=True` the
    output carries the mask `index != 0`, stacked `(N, B, T)` like the output.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `Embedding` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_core import FusedEmbedding

    config = keras.layers.Embedding(10, 4).get_config()
    layer = FusedEmbedding(n_members=2, member_config=config, input_stacked=False)
    print(layer(keras.ops.zeros((3, 5), dtype="int32")).shape)  # (2, 3, 5, 4)
    ```
    """

    handles_masks = True
    size_keys = ("output_dim",)
    regularizer_keys = ("embeddings_regularizer",)

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.input_dim = int(member_config["input_dim"])
        self.member_dims = [int(d or 0) for d in self.per_member("output_dim")]
        self.output_dim = max(self.member_dims)
        self.mask_zero = bool(member_config.get("mask_zero", False))
        self.out_layout = layout_lib.prefix(self.member_dims, self.output_dim)
        self.table_mask = _padding.mask_or_none(self.out_layout[:, None, :])

    @classmethod
    def unsupported_reason(cls, member_config):
        return unsupported_options(member_config, keys=("sparse",))

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        dims = [0 if layer is None else int(layer.output_dim) for layer in layers]
        return [layout_lib.prefix(dims)], None

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.n_members, self.input_dim, self.output_dim),
            regularizer=_regularizer(self.member_config, "embeddings_regularizer"),
        )

    def member_weight_index(self, k, i):
        if self.table_mask is None:
            return 0, None
        return 0, (None, np.flatnonzero(self.out_layout[i]))

    def call(self, inputs, training=None):
        table = _padding.masked(self.embeddings, self.table_mask)
        if inputs.dtype not in ("int32", "int64"):
            inputs = ops.cast(inputs, "int32")
        if not self.input_is_stacked():
            return ops.take(table, inputs, axis=1)
        rank = len(inputs.shape)
        offsets = ops.arange(self.n_members, dtype=inputs.dtype) * self.input_dim
        offsets = ops.reshape(offsets, (self.n_members,) + (1,) * (rank - 1))
        table = ops.reshape(table, (-1, self.output_dim))
        return ops.take(table, inputs + offsets, axis=0)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero:
            return None
        return self.stacked_mask(ops.not_equal(inputs, 0))


@register_fused_layer(keras.layers.Dropout)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedDropout(FusedLayer):
    """Dropout with an independent mask, and its own rate, for every member.

    The mask is drawn over the whole stacked `(N, B, ...)` tensor, so no two members
    share it; a member `noise_shape` gets the member axis prepended. Members may use
    different rates (tuning the dropout rate is common): each keeps a unit with
    probability `1 - rate_i` and scales it by `1 / (1 - rate_i)`, as Keras's `Dropout`.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `Dropout` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_core import FusedDropout

    config = keras.layers.Dropout(0.5).get_config()
    layer = FusedDropout(n_members=2, member_config=config, input_stacked=False)
    print(layer(keras.ops.ones((3, 4)), training=True).shape)  # (2, 3, 4)
    ```
    """

    per_member_keys = ("rate",)
    slot_keys = ("rate",)
    handles_masks = True
    passes_layout = True
    skippable = True

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.rates = [float(r or 0.0) for r in self.per_member("rate")]
        noise_shape = member_config.get("noise_shape")
        self.noise_shape = None if noise_shape is None else (n_members, *noise_shape)
        self.seed_generator = keras.random.SeedGenerator(member_config.get("seed"))

    def build(self, input_shape):
        if self.settings.held:
            self.slot_rate = self.add_slot_variable("slot_rate", self.rates, "float32")

    def member_weight_index(self, k, i):
        return None, None

    def load_member(self, j, layer):
        _set_row(self.slot_rate, j, float(layer.rate))

    def call(self, inputs, training=None):
        x = self.to_stacked(inputs)
        if not training or not (any(self.rates) or self.settings.held):
            return x
        if len(set(self.rates)) == 1 and not self.settings.held:
            return keras.random.dropout(
                x, self.rates[0], noise_shape=self.noise_shape, seed=self.seed_generator
            )
        shape = ops.shape(x)
        if self.noise_shape is not None:
            shape = [shape[i] if d is None else d for i, d in enumerate(self.noise_shape)]
        if self.settings.held:
            keep = 1.0 - ops.cast(self.slot_rate, x.dtype)
        else:
            keep = ops.convert_to_tensor([1.0 - r for r in self.rates], dtype=x.dtype)
        keep = self.member_broadcast(keep, len(x.shape))
        draw = keras.random.uniform(shape, seed=self.seed_generator, dtype=x.dtype)
        return ops.where(draw < keep, x / ops.maximum(keep, 1e-12), ops.zeros_like(x))

    def compute_mask(self, inputs, mask=None):
        return self.stacked_mask(mask)


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedPerSample(FusedLayer):
    """A layer without weights run once on the member axis folded into the batch.

    Stacked `(N, B, ...)` inputs are reshaped to `(N * B, ...)`, the member layer runs
    unchanged, and the result is reshaped back; when every input is replicated the
    layer runs once on the shared batch and its output stays replicated. Right for any
    layer whose output for a sample depends only on that sample and that has no weights
    or randomness: activations, pooling, flattening, reshaping, merging. Keras masks fold
    and unfold with the tensors, so masked pooling and `Masking` compute what the member
    layer does.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member layer serialized with
            `keras.saving.serialize_keras_object` (class and config). Defaults to none
            (required).
        input_stacked: Whether each input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_core import FusedPerSample

    member = keras.saving.serialize_keras_object(keras.layers.Flatten())
    layer = FusedPerSample(n_members=2, member_config=member)
    print(layer(keras.ops.ones((2, 3, 4, 5))).shape)  # (2, 3, 20)
    ```
    """

    handles_masks = True
    skippable = True

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        serialized = {k: v for k, v in member_config.items() if k != "input_layouts"}
        self.inner = keras.saving.deserialize_keras_object(serialized)
        self.supports_masking = self.inner.supports_masking

    @classmethod
    def from_member(cls, layer, n_members, input_stacked, member_layers=(), input_layouts=None):
        config = keras.saving.serialize_keras_object(layer)
        if input_layouts is not None and not all(layout_lib.is_full(x) for x in input_layouts):
            config["input_layouts"] = [layout_lib.to_config(x) for x in input_layouts]
        return cls(
            n_members=n_members,
            member_config=config,
            input_stacked=input_stacked,
            name=layer.name,
            trainable=layer.trainable,
            dtype=layer.dtype_policy,
        )

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        """Padded features pass through layers that treat each feature on its own (pooling,
        element-wise activations, merges of like inputs); `Flatten` repeats the feature
        layout over the flattened positions, `Concatenate` lays layouts side by side."""
        if all(layout_lib.is_full(x) for x in input_layouts):
            return [None], None
        layer = next(m for m in layers if m is not None)
        name = type(layer).__name__
        widths = [shape[-1] for shape in input_shapes]
        layouts = [
            layout_lib.full(w, len(layers)) if x is None else x
            for x, w in zip(input_layouts, widths)
        ]
        if name in _FEATURE_WISE:
            return [input_layouts[0]], None
        if name == "Flatten":
            positions = int(np.prod(input_shapes[0][1:-1], dtype=int))
            return [layout_lib.repeat(layouts[0], positions)], None
        if name in _MERGES and all(np.array_equal(x, layouts[0]) for x in layouts):
            return [input_layouts[0]], None
        if name == "Concatenate":
            rank = len(input_shapes[0])
            if layer.axis in (-1, rank - 1):
                return [layout_lib.concat(layouts)], None
            if all(np.array_equal(x, layouts[0]) for x in layouts):
                return [input_layouts[0]], None
        return None, (
            f"`{name}` cannot take members' inputs of different sizes (features padded to the "
            "widest member)"
        )

    @property
    def xla_pays_on_cpu(self):
        """Not for pooling (see `FusedLayer`); yes for the other per-sample layers."""
        return type(self.inner).__name__ not in _POOLING

    @property
    def output_stacked(self):
        flags = self.input_stacked
        return any(flags) if isinstance(flags, (list, tuple)) else bool(flags)

    def call(self, inputs, training=None, mask=None):
        if not self.output_stacked:
            return self.inner(inputs, **self._call_kwargs(mask, training))
        folded, folded_mask = self._folded(inputs, mask)
        outputs = self.inner(folded, **self._call_kwargs(folded_mask, training))
        return keras.tree.map_structure(lambda y: unfold(y, self.n_members), outputs)

    def compute_mask(self, inputs, mask=None):
        if not self.inner.supports_masking:
            return None
        if not self.output_stacked:
            return self.inner.compute_mask(inputs, mask)
        folded, folded_mask = self._folded(inputs, mask)
        masks = self.inner.compute_mask(folded, folded_mask)
        return keras.tree.map_structure(
            lambda m: None if m is None else unfold(m, self.n_members), masks
        )

    def _call_kwargs(self, mask, training):
        kwargs = {}
        if _upstream.call_takes_training(self.inner):
            kwargs["training"] = training
        masked = any(m is not None for m in keras.tree.flatten(mask))
        if masked and _upstream.call_takes_mask(self.inner):
            kwargs["mask"] = mask
        return kwargs

    def _folded(self, inputs, mask):
        """Inputs and their masks stacked, then with the member axis folded into the batch."""
        folded = keras.tree.map_structure(fold, self.to_stacked(inputs))
        if mask is None:
            return folded, None
        flags = self.stacked_flags(inputs)
        if keras.tree.is_nested(mask):
            masks = keras.tree.flatten(mask)
            masks = [self.stacked_mask(m, flag) for m, flag in zip(masks, flags)]
            mask = keras.tree.pack_sequence_as(mask, masks)
        else:
            mask = self.stacked_mask(mask, flags[0])
        return folded, keras.tree.map_structure(lambda m: None if m is None else fold(m), mask)


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedRandomPerSample(FusedPerSample):
    """A random layer without weights run on the member axis folded into the batch.

    Like `FusedPerSample`, but the input is always stacked first, so every member draws its
    own noise or dropout mask (`SpatialDropout`, `GaussianNoise`, `GaussianDropout`,
    `AlphaDropout`), as each member trained alone would.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member layer serialized with
            `keras.saving.serialize_keras_object` (class and config). Defaults to none
            (required).
        input_stacked: Whether each input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_core import FusedRandomPerSample

    member = keras.saving.serialize_keras_object(keras.layers.GaussianNoise(0.1))
    layer = FusedRandomPerSample(n_members=2, member_config=member, input_stacked=False)
    print(layer(keras.ops.ones((3, 4)), training=True).shape)  # (2, 3, 4)
    ```
    """

    @property
    def output_stacked(self):
        return True


@register_fused_layer(keras.layers.Activation)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedActivation(FusedLayer):
    """N `Activation` layers, each member with its own activation (relu, tanh, ...).

    When every member uses the same activation and the input is replicated, it runs once
    on the shared batch and the output stays replicated.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `Activation` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_core import FusedActivation

    config = keras.layers.Activation("relu").get_config()
    config["per_member"] = {"activation": ["relu", "tanh"]}
    layer = FusedActivation(n_members=2, member_config=config)
    print(layer(keras.ops.ones((2, 3, 4)) * -1.0)[:, 0, 0])  # [0, tanh(-1)]
    ```
    """

    per_member_keys = ("activation",)
    passes_layout = True
    skippable = True
    handles_masks = True

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        reason = padded_activation_problem(layers, input_layouts[0])
        return ([input_layouts[0]], None) if reason is None else (None, reason)

    @property
    def output_stacked(self):
        specs = {repr(spec) for spec in self.per_member("activation") if spec is not None}
        return self.input_is_stacked() or len(specs) > 1

    def call(self, inputs, training=None):
        if not self.output_stacked:
            spec = next(spec for spec in self.per_member("activation") if spec is not None)
            return keras.activations.get(spec)(inputs)
        return self.activate(self.to_stacked(inputs))

    def compute_mask(self, inputs, mask=None):
        return mask if not self.output_stacked else self.stacked_mask(mask)


def skip_name(layer_name: str) -> str:
    """The name of the `FusedSkip` that lets members leave out fused layer `layer_name`."""
    return f"{layer_name}_skip"


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedSkip(FusedLayer):
    """Each member's output of a layer, or its input where the member leaves the layer out.

    A member of a depth search with fewer layers than the others skips the extra ones:
    its tensor passes through them unchanged. The layer's input and output are stacked;
    the narrower of the two is widened with zeros (padding) to the other's width. Built for
    slots (`settings.HELD`), which members skip is data (`slot_present`), set by
    `set_present` when a model of another depth is loaded into a slot.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: `{"present": [bool per member]}`: whether each member has the layer.
            Defaults to none (required).
        input_stacked: Unused (both inputs are stacked). Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_core import FusedSkip

    layer = FusedSkip(n_members=2, member_config={"present": [True, False]})
    x, y = keras.ops.zeros((2, 3, 4)), keras.ops.ones((2, 3, 5))
    print(keras.ops.convert_to_numpy(layer([x, y]))[:, 0])  # member 1 keeps its input
    ```
    """

    slot_keys = ("present",)

    def build(self, input_shape):
        if self.settings.held:
            present = [float(p) for p in self.member_config["present"]]
            self.slot_present = self.add_slot_variable("slot_present", present, "float32")

    def set_present(self, j, present):
        """Slot `j` takes the layer's output (`True`) or passes its input on (`False`)."""
        _set_row(self.slot_present, j, float(present))

    def call(self, inputs, training=None):
        x, y = inputs
        width = max(x.shape[-1], y.shape[-1])
        x, y = _widen(x, width), _widen(y, width)
        if self.settings.held:
            present = ops.greater(self.slot_present, 0.5)
        else:
            present = ops.convert_to_tensor(np.asarray(self.member_config["present"]))
        keep = self.member_broadcast(present, len(y.shape))
        return ops.where(keep, y, x)


def _widen(x, width):
    """`x` with zero features appended up to `width`."""
    extra = width - x.shape[-1]
    if not extra:
        return x
    return ops.pad(x, [[0, 0]] * (len(x.shape) - 1) + [[0, extra]])


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedBroadcast(FusedLayer):
    """Copy a replicated `(B, ...)` tensor to every member: `(N, B, ...)`.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: Unused; pass `{}`. Defaults to none (required).
        input_stacked: Whether the input is already stacked. Defaults to `False`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_core import FusedBroadcast

    layer = FusedBroadcast(n_members=3, member_config={})
    print(layer(keras.ops.ones((2, 4))).shape)  # (3, 2, 4)
    ```
    """

    handles_masks = True

    def __init__(self, n_members, member_config, input_stacked=False, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)

    def call(self, inputs, training=None):
        return self.to_stacked(inputs)

    def compute_mask(self, inputs, mask=None):
        return self.stacked_mask(mask)


_PER_SAMPLE = (
    "ReLU",
    "LeakyReLU",
    "ELU",
    "Softmax",
    "Identity",
    "Flatten",
    "Reshape",
    "Permute",
    "RepeatVector",
    "MaxPooling1D",
    "MaxPooling2D",
    "MaxPooling3D",
    "AveragePooling1D",
    "AveragePooling2D",
    "AveragePooling3D",
    "GlobalMaxPooling1D",
    "GlobalMaxPooling2D",
    "GlobalMaxPooling3D",
    "GlobalAveragePooling1D",
    "GlobalAveragePooling2D",
    "GlobalAveragePooling3D",
    "UpSampling1D",
    "UpSampling2D",
    "UpSampling3D",
    "ZeroPadding1D",
    "ZeroPadding2D",
    "ZeroPadding3D",
    "Cropping1D",
    "Cropping2D",
    "Cropping3D",
    "Masking",
    "Add",
    "Subtract",
    "Multiply",
    "Average",
    "Maximum",
    "Minimum",
    "Concatenate",
    "Dot",
    "Rescaling",
)
_POOLING = tuple(n for n in _PER_SAMPLE if "Pooling" in n)
# Per-sample layers that treat each feature (last axis) on its own, and merges of inputs
# laid out alike: padded features pass through them.
_FEATURE_WISE = {
    "ReLU",
    "LeakyReLU",
    "ELU",
    "Identity",
    "RepeatVector",
    "Rescaling",
    "SpatialDropout1D",
    "SpatialDropout2D",
    "SpatialDropout3D",
    "GaussianNoise",
    "GaussianDropout",
    "AlphaDropout",
    *(n for n in _PER_SAMPLE if "Pooling" in n or n.startswith(("UpSampling", "Zero", "Crop"))),
}
_MERGES = {"Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum"}

for _name in _PER_SAMPLE:
    register_fused_layer(getattr(keras.layers, _name))(FusedPerSample)

_RANDOM_PER_SAMPLE = (
    "SpatialDropout1D",
    "SpatialDropout2D",
    "SpatialDropout3D",
    "GaussianNoise",
    "GaussianDropout",
    "AlphaDropout",
)
for _name in _RANDOM_PER_SAMPLE:
    register_fused_layer(getattr(keras.layers, _name))(FusedRandomPerSample)
