"""Shared helpers of fused layers: unsupported options, member regularizers."""

import keras

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
    """Return the regularizer stored under `key` in a member config, or `None`.

    Applied to a stacked weight, an additive regularizer (L1, L2) gives the sum of the
    members' penalties, the penalty of the summed member losses.
    """
    value = config.get(key)
    return None if value is None else keras.regularizers.get(value)
