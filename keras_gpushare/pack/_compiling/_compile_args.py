"""Each member's `compile` arguments from the pack's, or from the member's own compile.

`pack.compile(optimizer=..., loss=..., metrics=...)` takes one value for all members or a
list of one per member; an argument left at `None` keeps what each member was compiled with
(its own optimizer, with its state, its loss and its metrics), as a user who compiled the
members before packing them expects. What no member gives falls back to Keras's defaults.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import keras
from keras import tree

from keras_gpushare import _upstream
from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack import members as members_lib

_DEFAULT_OPTIMIZER = "rmsprop"


def _own(member: keras.Model) -> dict:
    """What `member` was compiled with, as the objects it was given (`{}` when it was not).

    The objects themselves, not their serialized form: a loss function or metric class that
    is not registered with Keras's serialization compiles (as in Keras, registration is
    needed only to load a saved file).
    """
    config = _upstream.compile_arguments(member)
    if config:
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
    if keep_own:
        metrics = [config.get("metrics") for config in own]
        weighted_metrics = [config.get("weighted_metrics") for config in own]
    metric_specs = _member_metrics(metrics, n)
    weighted_specs = _member_metrics(weighted_metrics, n)
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
            args["loss_weights"] = own[i].get("loss_weights")
        result.append(args)
    return result


def _member_metrics(metrics: Any, n: int) -> list:
    """Returns per-member metric specs; a metric object that more than one member would
    get is copied for each of them (each member needs its own metric state).

    A list whose items are themselves lists, dicts or None, with one item per member, is read
    per member (`[["mae"], ["mse", "mae"]]`); anything else is one spec for all members. A
    metric object that only one member gets is that member's, as `keras.Model.compile`
    takes it.
    """
    nested = isinstance(metrics, (list, tuple)) and any(
        isinstance(v, (list, tuple, dict)) or v is None for v in metrics
    )
    if nested and len(metrics) != n:
        raise ValueError(
            f"Invalid value for argument `metrics`: got {len(metrics)} per-member metric "
            f"lists for {n} members. Pass one list of metrics for all members (e.g. "
            f'["mae"]) or a list of {n} lists.'
        )
    specs = list(metrics) if nested else [metrics] * n
    uses = Counter(
        id(leaf)
        for spec in specs
        for leaf in tree.flatten(spec)
        if isinstance(leaf, keras.metrics.Metric)
    )
    shared = {key for key, count in uses.items() if count > 1}

    def own_state(leaf: Any) -> Any:
        if isinstance(leaf, keras.metrics.Metric) and id(leaf) in shared:
            return members_lib.clone_metric(leaf, n)
        return leaf

    return [tree.map_structure(own_state, spec) for spec in specs]
