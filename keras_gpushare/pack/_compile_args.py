"""Each member's `compile` arguments from the pack's, or from the member's own compile.

`pack.compile(optimizer=..., loss=..., metrics=...)` takes one value for all members or a
list of one per member; an argument left at `None` keeps what each member was compiled with
(its own optimizer, with its state, its loss and its metrics), as a user who compiled the
members before packing them expects. What no member gives falls back to Keras's defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack import members as members_lib

_DEFAULT_OPTIMIZER = "rmsprop"


def _own(member: keras.Model) -> dict:
    """What `member` was compiled with (`{}` when it was not)."""
    if not member.compiled:
        return {}
    config = keras.saving.deserialize_keras_object(member.get_compile_config())
    config["optimizer"] = member.optimizer
    return config


def member_args(
    members: Sequence[keras.Model],
    optimizer: Any,
    loss: Any,
    loss_weights: Any,
    metrics: Any,
    weighted_metrics: Any,
    run_eagerly: bool,
    auto_scale_loss: bool,
) -> list[dict]:
    """One dict of `keras.Model.compile` arguments per member.

    Raises:
        ValueError: naming the argument and member when a value cannot be used.
    """
    n = len(members)
    own = [_own(m) for m in members]
    # `pack.compile()` naming neither a loss nor metrics compiles each member as it was.
    keep_own = loss is None and loss_weights is None and metrics is None and not weighted_metrics
    if loss is None:
        missing = [i for i, config in enumerate(own) if config.get("loss") is None]
        if missing:
            raise ValueError(
                "Invalid value for argument `loss`: got None, and members "
                f"{missing} were not compiled with a loss of their own. Pass one loss for all "
                f'members (e.g. `loss="mse"`), a list of {n}, or compile each member first.'
            )
        losses = [config["loss"] for config in own]
    else:
        losses = members_lib.member_losses(loss, n, [data_lib.output_count(m) for m in members])
        for i, member_loss in enumerate(losses):
            if member_loss is None:
                raise ValueError(f"Invalid loss for member {i}: got None. Pass a loss.")
    if optimizer is None:
        optimizers = [
            config.get("optimizer") or keras.optimizers.get(_DEFAULT_OPTIMIZER) for config in own
        ]
        members_lib.check_distinct_optimizers(optimizers)
    else:
        optimizers = members_lib.member_optimizers(optimizer, n)
    metric_specs = members_lib.member_metrics(metrics, n)
    weighted_specs = members_lib.member_metrics(weighted_metrics, n)
    result = []
    for i in range(n):
        args = {
            "optimizer": optimizers[i],
            "loss": losses[i],
            "loss_weights": loss_weights,
            "metrics": metric_specs[i],
            "weighted_metrics": weighted_specs[i],
            "run_eagerly": run_eagerly,
            "jit_compile": False,
            "auto_scale_loss": auto_scale_loss,
        }
        if keep_own:
            for key in ("loss_weights", "metrics", "weighted_metrics"):
                args[key] = own[i].get(key)
        result.append(args)
    return result
