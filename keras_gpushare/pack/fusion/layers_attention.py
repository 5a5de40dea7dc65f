"""Fused form of MultiHeadAttention: per-member projections, attention on members folded."""

import math

import keras
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack.fusion._checks import regularizer as _regularizer
from keras_gpushare.pack.fusion._checks import unsupported_options
from keras_gpushare.pack.fusion.base import FusedLayer, fold, unfold
from keras_gpushare.pack.fusion.registry import register_fused_layer


def _fold_optional(x):
    return None if x is None else fold(x)


@register_fused_layer(keras.layers.MultiHeadAttention)
@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedMultiHeadAttention(FusedLayer):
    """N MultiHeadAttention layers: batched projections, one attention for all members.

    The query, key, value and output projections are batched matmuls over the members'
    stacked kernels (`(N, dim, heads, key_dim)` and so on, each member's own layout).
    Between them the members are folded into the batch axis and the attention runs once,
    as Keras's `MultiHeadAttention` computes it: the masks Keras derives from the inputs'
    masks, `attention_mask`, `use_causal_mask` and `sliding_window` combined the same way;
    `ops.dot_product_attention` where Keras uses it (no dropout, no scores returned, rank-3
    inputs), the einsum, masked softmax and dropout otherwise. Dropout masks are drawn
    independently for every member.

    Args:
        n_members: Number of members. Defaults to none (required).
        member_config: The member `MultiHeadAttention` config. Defaults to none (required).
        input_stacked: Whether the query is stacked. Defaults to `True`.
        **kwargs: Base layer keyword arguments.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion.layers_attention import FusedMultiHeadAttention

    config = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4).get_config()
    layer = FusedMultiHeadAttention(n_members=3, member_config=config)
    x = keras.ops.ones((3, 5, 7, 6))  # (members, batch, steps, features)
    print(layer(x, x, use_causal_mask=True).shape)  # (3, 5, 7, 6)
    ```
    """

    regularizer_keys = ("kernel_regularizer", "bias_regularizer")
    handles_masks = True

    def __init__(self, n_members, member_config, input_stacked=True, **kwargs):
        super().__init__(n_members, member_config, input_stacked, **kwargs)
        config = member_config
        self.num_heads = int(config["num_heads"])
        self.key_dim = int(config["key_dim"])
        self.value_dim = int(config.get("value_dim") or self.key_dim)
        self.dropout = float(config.get("dropout", 0.0))
        self.use_bias = config.get("use_bias", True)
        output_shape = config.get("output_shape")
        if isinstance(output_shape, int):
            output_shape = (output_shape,)
        self.output_dims = tuple(output_shape) if output_shape else None
        axes = config.get("attention_axes")
        self.attention_axes = (axes,) if isinstance(axes, int) else axes
        self.sliding_window = config.get("sliding_window")
        self.inverse_sqrt_key_dim = 1.0 / math.sqrt(float(self.key_dim))
        self.flash_attention = keras.config.is_flash_attention_enabled()
        self.seed_generator = keras.random.SeedGenerator(config.get("seed"))
        self.supports_masking = True

    @classmethod
    def unsupported_reason(cls, member_config):
        if member_config.get("use_gate"):
            return "option `use_gate=True` is not supported by the fused form"
        return unsupported_options(member_config)

    def _projection(self, name, in_dim, heads_dim):
        kernel = self.add_weight(
            name=f"{name}_kernel",
            shape=(self.n_members, in_dim, self.num_heads, heads_dim),
            regularizer=_regularizer(self.member_config, "kernel_regularizer"),
        )
        bias = None
        if self.use_bias:
            bias = self.add_weight(
                name=f"{name}_bias",
                shape=(self.n_members, self.num_heads, heads_dim),
                initializer="zeros",
                regularizer=_regularizer(self.member_config, "bias_regularizer"),
            )
        return kernel, bias

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        # Keras's order of weights: query, key, value, output.
        self.query_kernel, self.query_bias = self._projection(
            "query", query_shape[-1], self.key_dim
        )
        self.key_kernel, self.key_bias = self._projection("key", key_shape[-1], self.key_dim)
        self.value_kernel, self.value_bias = self._projection(
            "value", value_shape[-1], self.value_dim
        )
        out = self.output_dims or (query_shape[-1],)
        self.output_kernel = self.add_weight(
            name="attention_output_kernel",
            shape=(self.n_members, self.num_heads, self.value_dim, *out),
            regularizer=_regularizer(self.member_config, "kernel_regularizer"),
        )
        self.output_bias = None
        if self.use_bias:
            self.output_bias = self.add_weight(
                name="attention_output_bias",
                shape=(self.n_members, *out),
                initializer="zeros",
                regularizer=_regularizer(self.member_config, "bias_regularizer"),
            )
        member_rank = len(query_shape) - (1 if self.input_is_stacked() else 0)
        self._build_attention(member_rank + 1)

    def _build_attention(self, rank):
        """Keras's attention equations for a member's projected tensors of `rank`."""
        if self.attention_axes is None:
            axes = tuple(range(1, rank - 2))
        else:
            axes = tuple(a if a >= 0 else (rank - 1) + a for a in self.attention_axes)
        self.member_attention_axes = axes
        self.dot_product_equation, self.combine_equation, scores_rank = (
            _upstream.attention_equations(rank, attn_axes=axes)
        )
        norm_axes = tuple(range(scores_rank - len(axes), scores_rank))
        self.softmax = keras.layers.Softmax(axis=norm_axes, dtype=self.dtype_policy)

    def compute_output_spec(self, query, value, key=None, return_attention_scores=False, **kwargs):
        shape = tuple(query.shape)
        if not self.input_is_stacked():
            shape = (self.n_members, *shape)
        output = keras.KerasTensor(
            shape[:-1] + (self.output_dims or shape[-1:]), dtype=self.compute_dtype
        )
        if not return_attention_scores:
            return output
        if len(shape) != 4:
            return super().compute_output_spec(
                query, value, key=key, return_attention_scores=True, **kwargs
            )
        scores = (self.n_members, shape[1], self.num_heads, shape[2], value.shape[-2])
        return output, keras.KerasTensor(scores, dtype=self.compute_dtype)

    def compute_mask(self, inputs, mask=None):
        return self.stacked_mask(mask)

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        key = value if key is None else key
        query_mask = self.stacked_mask(query_mask)
        query = query if self.input_is_stacked() else self.stack(query)
        causal_only = (
            use_causal_mask
            and query_mask is None
            and value_mask is None
            and key_mask is None
            and attention_mask is None
            and self.sliding_window is None
        )
        q = fold(self._project(query, self.query_kernel, self.query_bias))
        k = fold(self._project(key, self.key_kernel, self.key_bias))
        v = fold(self._project(value, self.value_kernel, self.value_bias))
        mask = None
        if not causal_only:
            mask = self._attention_mask(
                q,
                v,
                _fold_optional(query_mask),
                _fold_optional(value_mask),
                _fold_optional(key_mask),
                _fold_optional(attention_mask),
                use_causal_mask,
            )
        output, scores = self._attention(
            q, k, v, mask, training, return_attention_scores, causal_only
        )
        output = self._output(unfold(output, self.n_members))
        if return_attention_scores:
            return output, unfold(scores, self.n_members)
        return output

    def _project(self, x, kernel, bias):
        """`(N, B, ..., dim)` times `(N, dim, heads, d)` (plus bias): `(N, B, ..., heads, d)`."""
        kernel = ops.cast(kernel, self.compute_dtype)
        n, in_dim, heads, width = kernel.shape
        lead = ops.shape(x)[1:-1]
        y = ops.matmul(ops.reshape(x, (n, -1, in_dim)), ops.reshape(kernel, (n, in_dim, -1)))
        y = ops.reshape(y, (n, *lead, heads, width))
        if bias is not None:
            y = y + self.member_broadcast(ops.cast(bias, self.compute_dtype), len(y.shape))
        return y

    def _output(self, x):
        """`(N, B, ..., heads, value_dim)` projected to the output: `(N, B, ..., *out)`."""
        kernel = ops.cast(self.output_kernel, self.compute_dtype)
        n = self.n_members
        out = tuple(kernel.shape[3:])
        lead = ops.shape(x)[1:-2]
        depth = self.num_heads * self.value_dim
        y = ops.matmul(ops.reshape(x, (n, -1, depth)), ops.reshape(kernel, (n, depth, -1)))
        y = ops.reshape(y, (n, *lead, *out))
        if self.output_bias is not None:
            y = y + self.member_broadcast(
                ops.cast(self.output_bias, self.compute_dtype), len(y.shape)
            )
        return y

    def _attention_mask(
        self, query, value, query_mask, value_mask, key_mask, attention_mask, causal
    ):
        """Keras's `_compute_attention_mask` on member-shaped (folded) tensors."""
        auto_mask = None
        if query_mask is not None:
            auto_mask = ops.expand_dims(ops.cast(query_mask, "bool"), -1)
        if value_mask is not None:
            mask = ops.expand_dims(ops.cast(value_mask, "bool"), -2)
            auto_mask = mask if auto_mask is None else auto_mask & mask
        if key_mask is not None:
            mask = ops.expand_dims(ops.cast(key_mask, "bool"), -2)
            auto_mask = mask if auto_mask is None else auto_mask & mask
        q_length, v_length = ops.shape(query)[1], ops.shape(value)[1]
        if causal:
            ones = ops.ones((1, q_length, v_length), dtype="int32")
            mask = ops.greater_equal(ops.cumsum(ones, axis=-2), ops.cumsum(ones, axis=-1))
            auto_mask = mask if auto_mask is None else auto_mask & mask
        if self.sliding_window is not None:
            rows = ops.reshape(ops.arange(q_length, dtype="int32"), (1, q_length, 1))
            columns = ops.reshape(ops.arange(v_length, dtype="int32"), (1, 1, v_length))
            mask = ops.less(ops.abs(rows - columns), self.sliding_window)
            auto_mask = mask if auto_mask is None else auto_mask & mask
        if attention_mask is not None:
            attention_mask = ops.cast(attention_mask, "bool")
        if auto_mask is not None:
            attention_mask = auto_mask if attention_mask is None else attention_mask & auto_mask
        return attention_mask

    def _expand_mask(self, mask, rank):
        axis = -len(self.member_attention_axes) * 2 - 1
        for _ in range(rank - len(mask.shape)):
            mask = ops.expand_dims(mask, axis=axis)
        return mask

    def _attention(self, query, key, value, mask, training, return_scores, causal_only):
        """Keras's `_compute_attention` on member-shaped (folded) tensors."""
        use_dot_product_attention = not (
            self.dropout > 0.0 or return_scores or len(query.shape) != 4
        )
        if use_dot_product_attention:
            if mask is not None:
                mask = ops.cast(self._expand_mask(mask, 4), "bool")
            output = ops.dot_product_attention(
                query=query,
                key=key,
                value=value,
                bias=None,
                mask=mask,
                scale=self.inverse_sqrt_key_dim,
                is_causal=causal_only,
                flash_attention=self.flash_attention,
            )
            return output, None
        if causal_only:
            ones = ops.ones((1, ops.shape(query)[1], ops.shape(value)[1]), dtype="int32")
            mask = ops.greater_equal(ops.cumsum(ones, axis=-2), ops.cumsum(ones, axis=-1))
        query = ops.multiply(query, ops.cast(self.inverse_sqrt_key_dim, query.dtype))
        scores = ops.einsum(self.dot_product_equation, key, query)
        if mask is not None:
            mask = self._expand_mask(mask, len(scores.shape))
        scores = self.softmax(scores, mask=mask)
        dropped = scores
        if training and self.dropout > 0.0:
            dropped = keras.random.dropout(scores, self.dropout, seed=self.seed_generator)
        return ops.einsum(self.combine_equation, dropped, value), scores
