"""Fused forms of LSTM, GRU and SimpleRNN: one recurrent loop for all members."""

import keras
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack.fusion._checks import regularizer as _regularizer
from keras_gpushare.pack.fusion._checks import unsupported_options
from keras_gpushare.pack.fusion.base import FusedLayer
from keras_gpushare.pack.fusion.registry import register_fused_layer


class _FusedRNN(FusedLayer):
    """N recurrent layers of one kind in one loop over time.

    The members' input projections for all time steps are one batched matmul before the
    loop; each step is one batched matmul `(N, B, units) x (N, units, gates * units)` plus
    the gate arithmetic, inside Keras's own backend loop (`keras.src.backend.rnn`, a
    `tf.while_loop` or `jax.lax.scan`), which also applies masks, `go_backwards` and
    `zero_output_for_mask` exactly as the member layers do. The gate axis of every weight
    is laid out as in Keras (`gates * units`, gate-major), so it can be viewed as
    `(gates, units)`.

    Dropout follows Keras's semantics per member: one input mask and one recurrent mask
    per sequence, the same at every step, drawn independently for every member (one per
    gate when `recurrent_dropout` is set, as Keras's implementation 1 does). The random
    draws are not Keras's own, so only their distribution matches a member's.

    Subclasses set `gates` and `state_count` and implement `_bias_shape`,
    `_projection_bias` and `_step_function`.
    """

    regularizer_keys = ("kernel_regularizer", "recurrent_regularizer", "bias_regularizer")
    gates = 1
    state_count = 1
    handles_masks = True

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        config = member_config
        self.units = int(config["units"])
        self.activation = keras.activations.get(config.get("activation", "tanh"))
        self.use_bias = config.get("use_bias", True)
        self.return_sequences = config.get("return_sequences", False)
        self.return_state = config.get("return_state", False)
        self.go_backwards = config.get("go_backwards", False)
        self.zero_output_for_mask = config.get("zero_output_for_mask", False)
        self.dropout = min(1.0, max(0.0, float(config.get("dropout", 0.0))))
        self.recurrent_dropout = min(1.0, max(0.0, float(config.get("recurrent_dropout", 0.0))))
        self.seed_generator = keras.random.SeedGenerator(config.get("seed"))
        self.supports_masking = True

    @classmethod
    def unsupported_reason(cls, member_config):
        if member_config.get("stateful"):
            return (
                "option `stateful=True` carries states from batch to batch; the fused form does not"
            )
        return unsupported_options(member_config)

    @property
    def per_gate_masks(self):
        """Whether every gate has its own dropout masks (Keras's implementation 1)."""
        return self.gates > 1 and self.recurrent_dropout != 0.0

    def build(self, sequences_shape, initial_state_shape=None):
        input_dim = sequences_shape[-1]
        width = self.gates * self.units
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.n_members, input_dim, width),
            regularizer=_regularizer(self.member_config, "kernel_regularizer"),
        )
        self.recurrent_kernel = self.add_weight(
            name="recurrent_kernel",
            shape=(self.n_members, self.units, width),
            regularizer=_regularizer(self.member_config, "recurrent_regularizer"),
        )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.n_members, *self._bias_shape()),
                initializer="zeros",
                regularizer=_regularizer(self.member_config, "bias_regularizer"),
            )

    def compute_output_shape(self, sequences_shape, initial_state_shape=None):
        batch, steps = sequences_shape[-3], sequences_shape[-2]
        state = (self.n_members, batch, self.units)
        output = (self.n_members, batch, steps, self.units) if self.return_sequences else state
        if self.return_state:
            return (output, *[state] * self.state_count)
        return output

    def compute_mask(self, inputs, mask=None):
        mask = keras.tree.flatten(mask)[0]
        output_mask = self.stacked_mask(mask) if self.return_sequences else None
        if self.return_state:
            return [output_mask] + [None] * self.state_count
        return output_mask

    def call(self, sequences, initial_state=None, mask=None, training=None):
        dtype = self.compute_dtype
        x = ops.cast(sequences, dtype)
        batch = ops.shape(x)[-3]
        input_masks = self._dropout_masks(batch, self.dropout, training, x.shape[-1])
        projected = self._project(x, input_masks)
        steps = projected.shape[2]
        if initial_state is None:
            zeros = ops.zeros((self.n_members, batch, self.units), dtype=dtype)
            states = [zeros] * self.state_count
        else:
            states = initial_state if keras.tree.is_nested(initial_state) else [initial_state]
            states = [ops.cast(s, dtype) for s in states]
        recurrent_masks = self._dropout_masks(batch, self.recurrent_dropout, training, self.units)
        step = self._step_function(recurrent_masks)
        if mask is not None:
            mask = self.stacked_mask(mask)
            mask = ops.expand_dims(ops.transpose(ops.cast(mask, "bool"), (0, 2, 1)), -1)
        # Keras's loop takes (batch, time, ...): the member axis stands in for the batch,
        # the real batch rides along as a feature axis.
        last, outputs, new_states = _upstream.backend_rnn(
            step,
            ops.transpose(projected, (0, 2, 1, 3)),
            states,
            go_backwards=self.go_backwards,
            mask=mask,
            unroll=False,
            input_length=steps,
            zero_output_for_mask=self.zero_output_for_mask,
            return_all_outputs=self.return_sequences,
        )
        if self.return_sequences:
            output = ops.cast(ops.transpose(outputs, (0, 2, 1, 3)), dtype)
        else:
            output = ops.cast(last, dtype)
        if self.return_state:
            return (output, *[ops.cast(s, dtype) for s in new_states])
        return output

    def _dropout_masks(self, batch, rate, training, width):
        """`None`, or per-member dropout masks `(N, B, width)` (`(gates, N, B, width)`)."""
        if not training or not 0.0 < rate < 1.0:
            return None
        shape = (self.n_members, batch, width)
        if self.per_gate_masks:
            shape = (self.gates, *shape)
        ones = ops.ones(shape, dtype=self.compute_dtype)
        return keras.random.dropout(ones, rate, seed=self.seed_generator)

    def _project(self, x, masks):
        """The input projection of every step, `(N, B, T, gates * units)`."""
        n, width = self.n_members, self.gates * self.units
        kernel = ops.cast(self.kernel, self.compute_dtype)
        in_dim = kernel.shape[1]
        if masks is None and not self.input_is_stacked():
            lead = ops.shape(x)[:-1]
            side_by_side = ops.reshape(ops.transpose(kernel, (1, 0, 2)), (in_dim, n * width))
            y = ops.matmul(ops.reshape(x, (-1, in_dim)), side_by_side)
            y = ops.transpose(ops.reshape(y, (-1, n, width)), (1, 0, 2))
            y = ops.reshape(y, (n, *lead, width))
        else:
            x = x if self.input_is_stacked() else self.stack(x)
            lead = ops.shape(x)[1:-1]
            if masks is None or not self.per_gate_masks:
                if masks is not None:
                    x = x * ops.expand_dims(masks, 2)
                y = ops.matmul(ops.reshape(x, (n, -1, in_dim)), kernel)
            else:
                pieces = []
                for g in range(self.gates):
                    xg = ops.reshape(x * ops.expand_dims(masks[g], 2), (n, -1, in_dim))
                    pieces.append(ops.matmul(xg, self._gate(kernel, g)))
                y = ops.concatenate(pieces, axis=-1)
            y = ops.reshape(y, (n, *lead, width))
        bias = self._projection_bias()
        if bias is not None:
            y = y + ops.reshape(bias, (n, 1, 1, width))
        return y

    def _gate(self, weight, g):
        """Gate `g`'s `units` columns of a `(N, ..., gates * units)` weight."""
        return weight[..., g * self.units : (g + 1) * self.units]

    def _weights(self):
        """The recurrent kernel and the bias in the compute dtype."""
        recurrent = ops.cast(self.recurrent_kernel, self.compute_dtype)
        bias = None if self.bias is None else ops.cast(self.bias, self.compute_dtype)
        return recurrent, bias

    def _bias_shape(self):
        raise NotImplementedError

    def _projection_bias(self):
        """The bias added to the input projection `(N, gates * units)`, or `None`."""
        raise NotImplementedError

    def _step_function(self, recurrent_masks):
        raise NotImplementedError


@register_fused_layer(keras.layers.LSTM)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedLSTM(_FusedRNN):
    """N LSTM layers in one loop: gates `i, f, c, o` as in Keras.

    Where Keras would use cuDNN (TensorFlow or JAX on a GPU, default activations, no
    recurrent dropout, no mask), the fused form runs the same arithmetic as Keras's
    generic kernel, vectorized over members, instead.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `LSTM` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_recurrent import FusedLSTM

    config = keras.layers.LSTM(5, return_sequences=True).get_config()
    layer = FusedLSTM(n_members=3, member_config=config, input_stacked=False)
    print(layer(keras.ops.ones((2, 7, 4))).shape)  # (3, 2, 7, 5)
    ```
    """

    gates = 4
    state_count = 2

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.recurrent_activation = keras.activations.get(
            member_config.get("recurrent_activation", "sigmoid")
        )

    def _bias_shape(self):
        return (4 * self.units,)

    def _projection_bias(self):
        # Keras adds the bias after the recurrent term, except in implementation 1.
        if self.bias is None or not self.per_gate_masks:
            return None
        return ops.cast(self.bias, self.compute_dtype)

    def _step_function(self, recurrent_masks):
        recurrent, bias = self._weights()
        per_gate = self.per_gate_masks
        activation, recurrent_activation = self.activation, self.recurrent_activation

        def step(projected, states):
            h, c = states[0], states[1]
            if recurrent_masks is not None:
                z = projected + ops.concatenate(
                    [
                        ops.matmul(h * recurrent_masks[g], self._gate(recurrent, g))
                        for g in range(4)
                    ],
                    axis=-1,
                )
            else:
                z = projected + ops.matmul(h, recurrent)
            if bias is not None and not per_gate:
                z = z + ops.expand_dims(bias, 1)
            z0, z1, z2, z3 = ops.split(z, 4, axis=-1)
            i = recurrent_activation(z0)
            f = recurrent_activation(z1)
            c = f * c + i * activation(z2)
            o = recurrent_activation(z3)
            h = o * activation(c)
            return h, [h, c]

        return step


@register_fused_layer(keras.layers.GRU)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedGRU(_FusedRNN):
    """N GRU layers in one loop: gates `z, r, h` as in Keras, both `reset_after` forms.

    With `reset_after=True` the bias is `(N, 2, 3 * units)`: input and recurrent biases,
    as in Keras. Where Keras would use cuDNN, the fused form runs Keras's generic
    arithmetic vectorized over members instead.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `GRU` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_recurrent import FusedGRU

    config = keras.layers.GRU(5, reset_after=False).get_config()
    layer = FusedGRU(n_members=3, member_config=config, input_stacked=False)
    print(layer(keras.ops.ones((2, 7, 4))).shape)  # (3, 2, 5)
    ```
    """

    gates = 3

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        self.recurrent_activation = keras.activations.get(
            member_config.get("recurrent_activation", "sigmoid")
        )
        self.reset_after = member_config.get("reset_after", True)

    def _bias_shape(self):
        return (2, 3 * self.units) if self.reset_after else (3 * self.units,)

    def _projection_bias(self):
        if self.bias is None:
            return None
        bias = ops.cast(self.bias, self.compute_dtype)
        return bias[:, 0] if self.reset_after else bias

    def _step_function(self, recurrent_masks):
        recurrent, bias = self._weights()
        recurrent_bias = bias[:, 1] if bias is not None and self.reset_after else None
        reset_after, units = self.reset_after, self.units
        activation, recurrent_activation = self.activation, self.recurrent_activation

        def gate_input(h, g):
            return h if recurrent_masks is None else h * recurrent_masks[g]

        def recurrent_term(h, g):
            y = ops.matmul(gate_input(h, g), self._gate(recurrent, g))
            if recurrent_bias is not None:
                y = y + ops.expand_dims(self._gate(recurrent_bias, g), 1)
            return y

        def step(projected, states):
            h = states[0]
            x_z, x_r, x_h = ops.split(projected, 3, axis=-1)
            if recurrent_masks is not None:
                r_z, r_r = recurrent_term(h, 0), recurrent_term(h, 1)
            elif reset_after:
                inner = ops.matmul(h, recurrent)
                if recurrent_bias is not None:
                    inner = inner + ops.expand_dims(recurrent_bias, 1)
                r_z, r_r, r_h = ops.split(inner, 3, axis=-1)
            else:
                r_z, r_r = ops.split(ops.matmul(h, recurrent[..., : 2 * units]), 2, axis=-1)
            z = recurrent_activation(x_z + r_z)
            r = recurrent_activation(x_r + r_r)
            if reset_after:
                if recurrent_masks is not None:
                    r_h = recurrent_term(h, 2)
                r_h = r * r_h
            else:
                r_h = ops.matmul(r * gate_input(h, 2), self._gate(recurrent, 2))
            hh = activation(x_h + r_h)
            h = z * h + (1 - z) * hh
            return h, [h]

        return step


@register_fused_layer(keras.layers.SimpleRNN)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedSimpleRNN(_FusedRNN):
    """N SimpleRNN layers in one loop: `h = activation(x W + b + h_prev U)` as in Keras.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `SimpleRNN` config. Defaults to none (required).
        input_stacked: Whether the input is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_recurrent import FusedSimpleRNN

    config = keras.layers.SimpleRNN(5, return_state=True).get_config()
    layer = FusedSimpleRNN(n_members=3, member_config=config, input_stacked=False)
    output, state = layer(keras.ops.ones((2, 7, 4)))
    print(output.shape, state.shape)  # (3, 2, 5) (3, 2, 5)
    ```
    """

    def _bias_shape(self):
        return (self.units,)

    def _projection_bias(self):
        return None if self.bias is None else ops.cast(self.bias, self.compute_dtype)

    def _step_function(self, recurrent_masks):
        recurrent, _ = self._weights()
        activation = self.activation

        def step(projected, states):
            h = states[0]
            if recurrent_masks is not None:
                h = h * recurrent_masks
            output = projected + ops.matmul(h, recurrent)
            if activation is not None:
                output = activation(output)
            return output, [output]

        return step
