"""Shared helpers of fused layers: unsupported options, regularizers, padded activations."""

from typing import Any

import keras
import numpy as np

_ADDITIVE_REGULARIZERS = ("L1", "L2", "L1L2", "l1", "l2", "l1_l2")


def unsupported_options(config, keys=()):
    """Return a reason when an option a fused layer cannot honour is set, else `None`.

    Constraints, activity regularizers, LoRA and quantization are rejected in every
    layer, plus the layer-specific `keys` whose value must be falsy.
    """
    for key, value in config.items():
        if key.endswith("_constraint") and value is not None:
            return f"option `{key}` is set; fused layers do not apply weight constraints"
        if key.endswith("_regularizer") and key != "activity_regularizer" and value:
            name = value.get("class_name") if isinstance(value, dict) else str(value)
            if name not in _ADDITIVE_REGULARIZERS:
                return (
                    f"option `{key}` uses `{name}`; fused layers support only additive "
                    "regularizers (L1, L2, L1L2)"
                )
    checks = ("activity_regularizer", "lora_rank", "quantization_config", *keys)
    for key in checks:
        if config.get(key):
            return f"option `{key}={config[key]!r}` is not supported by the fused form"
    if config.get("data_format", "channels_last") != "channels_last":
        return "only `data_format='channels_last'` is supported by the fused form"
    return None


def regularizer(config, key):
    """Return the regularizer of a stacked weight from a fused layer's config, or `None`.

    Members' values of `key` may differ (`config["per_member"][key]`, `None` for a member
    with none): the result applies each member's own regularizer to its slice of the
    stacked weight and sums the penalties. One regularizer for all members is returned as
    it is: applied to a stacked weight, an additive regularizer (L1, L2) gives that sum too.
    The pack's fused engine adds each member's penalty to that member's loss itself, from
    the member's own weights' regularizers; this one is what the fused model's `losses`
    hold.
    """
    values = config.get("per_member", {}).get(key)
    if values is None:
        value = config.get(key)
        return None if value is None else keras.regularizers.get(value)
    if all(v is None for v in values):
        return None
    if all(v == values[0] for v in values):
        return keras.regularizers.get(values[0])
    return MemberRegularizers([None if v is None else keras.regularizers.get(v) for v in values])


class MemberRegularizers(keras.regularizers.Regularizer):
    """The members' own regularizers on a stacked weight: member `i`'s on slice `i`.

    Args:
        regularizers: one regularizer (or `None`) per member.
    """

    def __init__(self, regularizers):
        self.regularizers = list(regularizers)

    def __call__(self, x):
        terms = [reg(x[i]) for i, reg in enumerate(self.regularizers) if reg is not None]
        return keras.ops.sum(keras.ops.stack(terms))

    def get_config(self):
        return {
            "regularizers": [
                None if reg is None else keras.regularizers.serialize(reg)
                for reg in self.regularizers
            ]
        }

    @classmethod
    def from_config(cls, config):
        return cls(
            [None if reg is None else keras.regularizers.get(reg) for reg in config["regularizers"]]
        )


# Keras activations computed feature by feature: on padded features they leave each
# member's own features as they are (the padding is masked downstream).
_ELEMENTWISE_ACTIVATIONS = frozenset(
    [
        "celu",
        "elu",
        "exponential",
        "gelu",
        "hard_shrink",
        "hard_sigmoid",
        "hard_silu",
        "hard_swish",
        "hard_tanh",
        "leaky_relu",
        "linear",
        "log_sigmoid",
        "mish",
        "relu",
        "relu6",
        "selu",
        "sigmoid",
        "silu",
        "soft_shrink",
        "softplus",
        "softsign",
        "sparse_plus",
        "squareplus",
        "swish",
        "tanh",
        "tanh_shrink",
        "threshold",
    ]
)


def padded_activation_problem(layers, layout, key="activation"):
    """Why the members' activations cannot run on features padded as `layout`, or `None`.

    An activation across features (`softmax`, `log_softmax`, `sparsemax`, `glu`, or a
    function Keras does not name) would mix a member's features with the padding.
    """
    if layout is None or bool(np.all(layout)):
        return None
    for layer in layers:
        if layer is None:
            continue
        spec = layer.get_config().get(key)
        if not elementwise_activation(spec):
            return (
                f"activation {_activation_name(spec) or spec!r} acts across features, so it "
                "cannot run on features padded to the widest member (give the members equal "
                "widths)"
            )
    return None


def elementwise_activation(spec: Any) -> bool:
    """Whether the activation `spec` (a layer config's value) acts feature by feature."""
    return _activation_name(spec) in _ELEMENTWISE_ACTIVATIONS


def _activation_name(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(keras.activations.get(spec), "__name__", "")
