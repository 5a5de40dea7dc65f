"""Fused forms of the wrapper layers Bidirectional and TimeDistributed."""

import inspect

import keras
from keras import ops

from keras_gpushare.pack.fusion import registry
from keras_gpushare.pack.fusion.base import FusedLayer
from keras_gpushare.pack.fusion.layers_recurrent import _FusedRNN

_MERGE_MODES = ("concat", "sum", "ave", "mul", None)


def _fused_inner(config, n_members, input_stacked, **overrides):
    """The fused form of the layer serialized in `config` (a wrapper's inner layer)."""
    layer = keras.saving.deserialize_keras_object(config)
    fused_class = registry.fused_form(type(layer))
    if overrides:
        return fused_class(
            n_members=n_members,
            member_config={**layer.get_config(), **overrides},
            input_stacked=input_stacked,
            name=layer.name,
            trainable=layer.trainable,
            dtype=layer.dtype_policy,
        )
    return fused_class.from_member(layer, n_members, input_stacked)


def _inner_reason(config):
    """Why the layer a wrapper holds cannot be fused, or `None`; and the layer."""
    try:
        layer = keras.saving.deserialize_keras_object(config)
    except (TypeError, ValueError) as e:
        return f"its wrapped layer cannot be rebuilt from its config ({e})", None
    fused_class = registry.fused_form(type(layer))
    if fused_class is None:
        return (
            f"the layer `{type(layer).__name__}` it wraps has no fused form; register one "
            "with `keras_gpushare.register_fused_layer`",
            layer,
        )
    reason = fused_class.unsupported_reason(layer.get_config())
    if reason:
        return f"the `{type(layer).__name__}` it wraps: {reason}", layer
    return None, layer


@registry.register_fused_layer(keras.layers.Bidirectional)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedBidirectional(FusedLayer):
    """N Bidirectional recurrent layers: a fused forward and a fused backward layer.

    Computes what Keras's `Bidirectional` does with the members' recurrent layers (the
    same merge modes, `zero_output_for_mask` forced to `return_sequences`, the backward
    sequence flipped back, `initial_state` split in halves), each direction one fused
    loop for all members. Weights: the forward layer's, then the backward layer's.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `Bidirectional` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_wrappers import FusedBidirectional

    member = keras.layers.Bidirectional(keras.layers.GRU(4, return_sequences=True))
    member.build((None, 7, 3))
    layer = FusedBidirectional(2, member.get_config(), input_stacked=False)
    print(layer(keras.ops.ones((5, 7, 3))).shape)  # (2, 5, 7, 8)
    ```
    """

    handles_masks = True

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.merge_mode = member_config.get("merge_mode", "concat")
        forward = member_config["layer"]
        backward = member_config.get("backward_layer")
        if backward is None:
            backward = {**forward, "config": {**forward["config"], "go_backwards": True}}
        sequences = forward["config"].get("return_sequences", False)
        self.forward_layer = _fused_inner(
            forward, n_members, input_stacked, zero_output_for_mask=sequences
        )
        self.backward_layer = _fused_inner(
            backward, n_members, input_stacked, zero_output_for_mask=sequences
        )
        self.return_sequences = self.forward_layer.return_sequences
        self.return_state = self.forward_layer.return_state
        self.supports_masking = True

    @classmethod
    def unsupported_reason(cls, member_config):
        if member_config.get("merge_mode", "concat") not in _MERGE_MODES:
            return f"merge mode {member_config['merge_mode']!r} is unknown"
        for key in ("layer", "backward_layer"):
            if member_config.get(key) is None:
                continue
            reason, layer = _inner_reason(member_config[key])
            if reason:
                return reason
            if not issubclass(registry.fused_form(type(layer)), _FusedRNN):
                return "only LSTM, GRU and SimpleRNN are fused inside `Bidirectional`"
        return None

    def build(self, sequences_shape, initial_state_shape=None):
        self.forward_layer.build(sequences_shape)
        self.backward_layer.build(sequences_shape)

    def compute_output_shape(self, sequences_shape, initial_state_shape=None):
        output = self.forward_layer.compute_output_shape(sequences_shape)
        states = ()
        if self.return_state:
            output, states = output[0], tuple(output[1:])
        if self.merge_mode == "concat":
            output = (*output[:-1], output[-1] * 2)
        elif self.merge_mode is None:
            output = (output, output)
        if self.return_state:
            if self.merge_mode is None:
                return (*output, *states, *states)
            return (output, *states, *states)
        return output

    def compute_mask(self, inputs, mask=None):
        if isinstance(mask, list):
            mask = mask[0]
        mask = self.stacked_mask(mask)
        if self.return_sequences:
            return (mask, mask) if not self.merge_mode else mask
        return (None, None) if not self.merge_mode else None

    def call(self, sequences, initial_state=None, mask=None, training=None):
        forward_state = backward_state = None
        if initial_state is not None:
            half = len(initial_state) // 2
            forward_state, backward_state = initial_state[:half], initial_state[half:]
        y = self.forward_layer(sequences, initial_state=forward_state, mask=mask, training=training)
        y_rev = self.backward_layer(
            sequences, initial_state=backward_state, mask=mask, training=training
        )
        states = ()
        if self.return_state:
            states = tuple(y[1:]) + tuple(y_rev[1:])
            y, y_rev = y[0], y_rev[0]
        y = ops.cast(y, self.compute_dtype)
        y_rev = ops.cast(y_rev, self.compute_dtype)
        if self.return_sequences:
            y_rev = ops.flip(y_rev, axis=2)
        if self.merge_mode == "concat":
            output = ops.concatenate([y, y_rev], axis=-1)
        elif self.merge_mode == "sum":
            output = y + y_rev
        elif self.merge_mode == "ave":
            output = (y + y_rev) / 2
        elif self.merge_mode == "mul":
            output = y * y_rev
        else:
            output = (y, y_rev)
        if self.return_state:
            return (*output, *states) if self.merge_mode is None else (output, *states)
        return output


@registry.register_fused_layer(keras.layers.TimeDistributed)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedTimeDistributed(FusedLayer):
    """N TimeDistributed layers: the wrapped layer's fused form on time folded into batch.

    Keras applies the wrapped layer to every time step on its own; for a layer whose
    output for a sample depends only on that sample (Dense, convolutions, dropout,
    per-sample layers) that is the layer applied once to `(N, B * T, ...)`, which is what
    the fused form does. Layers with batch statistics (`BatchNormalization`) or that take
    a mask are refused. The output mask is the input mask, as in Keras.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `TimeDistributed` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_wrappers import FusedTimeDistributed

    member = keras.layers.TimeDistributed(keras.layers.Dense(4))
    member.build((None, 7, 3))
    layer = FusedTimeDistributed(2, member.get_config(), input_stacked=False)
    print(layer(keras.ops.ones((5, 7, 3))).shape)  # (2, 5, 7, 4)
    ```
    """

    handles_masks = True

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.layer = _fused_inner(member_config["layer"], n_members, input_stacked)
        self.supports_masking = True

    @classmethod
    def unsupported_reason(cls, member_config):
        reason, layer = _inner_reason(member_config["layer"])
        if reason:
            return reason
        if isinstance(layer, keras.layers.BatchNormalization):
            return (
                "`BatchNormalization` inside `TimeDistributed` keeps statistics per time "
                "step; the fused form does not"
            )
        if "mask" in inspect.signature(layer.call).parameters:
            return f"the `{type(layer).__name__}` it wraps takes a mask per time step"
        return None

    @property
    def output_stacked(self):
        return self.layer.output_stacked

    def build(self, input_shape):
        lead = 2 if self.input_is_stacked() else 1
        self.layer.build((*input_shape[: lead - 1], None, *input_shape[lead + 1 :]))

    def compute_mask(self, inputs, mask=None):
        return self.stacked_mask(mask) if self.output_stacked else mask

    def call(self, inputs, training=None, mask=None):
        lead = 2 if self.input_is_stacked() else 1
        shape = ops.shape(inputs)
        steps = shape[lead]
        folded = ops.reshape(inputs, (*shape[: lead - 1], -1, *shape[lead + 1 :]))
        y = self.layer(folded, training=training)
        y_shape = ops.shape(y)
        y_lead = 1 if self.output_stacked else 0
        return ops.reshape(y, (*y_shape[:y_lead], -1, steps, *y_shape[y_lead + 1 :]))
