"""What a model must share with a pack's member to be loaded in its place (`load_member`).

Loading keeps the pack's compiled step: the member's slot takes the model's values (weights,
learning rate, a fresh optimizer state, zeroed metrics) but not its structure, so everything
the step was traced with must be the same: the layers and their settings, the loss and
metrics, and the optimizer's family and hyperparameters other than the learning rate.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack.fusion._member_settings import inner_optimizer
from keras_gpushare.pack.fusion.converter import comparable_config, member_graph

_COMPILE_KEYS = ("loss", "loss_weights", "metrics", "weighted_metrics")


def structure_difference(member: keras.Model, model: keras.Model) -> str | None:
    """How `model`'s layers differ from `member`'s, or `None` when they are the same.

    Names, seeds and initializers may differ (the weights are loaded); any other setting of
    any layer (a width, an activation, a dropout rate) is part of the compiled step.
    """
    if type(model) is not type(member):
        return f"it is a `{type(model).__name__}`, the member a `{type(member).__name__}`"
    graph, _ = member_graph(model)
    member_layers, _ = member_graph(member)
    if graph is None or member_layers is None:
        return _weights_difference(member, model)
    for node, member_node in zip(graph.nodes, member_layers.nodes):
        layer, own = node.operation, member_node.operation
        if type(layer) is not type(own):
            return (
                f"its layer `{layer.name}` is a `{type(layer).__name__}` where the member "
                f"has a `{type(own).__name__}`"
            )
        config = comparable_config(layer.get_config())
        expected_config = comparable_config(own.get_config())
        for key in sorted(set(config) | set(expected_config)):
            if config.get(key) != expected_config.get(key):
                return (
                    f"its layer `{layer.name}` sets `{key}={config.get(key)!r}` where the "
                    f"member's `{own.name}` has {expected_config.get(key)!r}"
                )
    if len(graph.nodes) != len(member_layers.nodes):
        return f"it has {len(graph.nodes)} layer calls, the member {len(member_layers.nodes)}"
    return _weights_difference(member, model)


def _weights_difference(member: keras.Model, model: keras.Model) -> str | None:
    shapes = [tuple(v.shape) for v in model.weights]
    expected = [tuple(v.shape) for v in member.weights]
    if shapes != expected:
        return f"its weights have the shapes {shapes}, the member's {expected}"
    return None


def compile_difference(member: keras.Model, model: keras.Model) -> str | None:
    """How `model`'s loss and metrics differ from `member`'s, or `None`."""
    if not model.compiled:
        return "it is not compiled; compile it as the member was"
    mine = _upstream.compile_arguments(model)
    theirs = _upstream.compile_arguments(member)
    for key in _COMPILE_KEYS:
        if _comparable(mine.get(key)) != _comparable(theirs.get(key)):
            return (
                f"it was compiled with `{key}={mine.get(key)!r}`, the member with "
                f"{theirs.get(key)!r}"
            )
    return None


def _comparable(value: Any) -> Any:
    """A compile argument as something `==` compares by what it computes."""
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if callable(value) and not hasattr(value, "get_config"):
        return value
    try:
        return keras.saving.serialize_keras_object(value)
    except (TypeError, ValueError):
        return value


def optimizer_difference(member_optimizer: Any, optimizer: Any) -> str | None:
    """How `optimizer` differs from `member_optimizer` beyond its learning rate, or `None`."""
    if type(optimizer) is not type(member_optimizer):
        return (
            f"its optimizer is a `{type(optimizer).__name__}`, the member's a "
            f"`{type(member_optimizer).__name__}`"
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        problem = optimizer_difference(member_optimizer.inner_optimizer, optimizer.inner_optimizer)
        if problem is not None:
            return problem
    config, expected = optimizer.get_config(), member_optimizer.get_config()
    for key in sorted(set(config) | set(expected)):
        if key in ("name", "learning_rate", "inner_optimizer"):
            continue
        if config.get(key) != expected.get(key):
            return (
                f"its optimizer sets `{key}={config.get(key)!r}` where the member's has "
                f"{expected.get(key)!r}; only the learning rate may differ"
            )
    schedules = [fixed_learning_rate(o) is None for o in (optimizer, member_optimizer)]
    if any(schedules) and config.get("learning_rate") != expected.get("learning_rate"):
        return (
            "its learning-rate schedule differs from the member's; a schedule is part of "
            "the compiled step, only a fixed learning rate may differ"
        )
    return None


def steps_taken(optimizer: Any) -> int:
    """How many steps `optimizer` has applied (0 for one not built)."""
    if optimizer is None or not optimizer.built:
        return 0
    return int(ops.convert_to_numpy(optimizer.iterations))


def fixed_learning_rate(optimizer: Any) -> float | None:
    """`optimizer`'s learning rate now, or `None` when it follows a schedule (or there is
    no optimizer)."""
    if optimizer is None:
        return None
    optimizer = inner_optimizer(optimizer)
    if isinstance(
        _upstream.raw_learning_rate(optimizer), keras.optimizers.schedules.LearningRateSchedule
    ):
        return None
    return float(ops.convert_to_numpy(optimizer.learning_rate))


def reset_optimizer(optimizer: Any, variables: list, learning_rate: float | None) -> None:
    """Puts `optimizer`'s state back to a new optimizer's (built on `variables`).

    Its step count, slots, accumulators and loss scale take the values a new optimizer of
    the same configuration starts with; a fixed learning rate becomes `learning_rate`
    (`None`: a schedule, which restarts with the step count).
    """
    if not optimizer.built:
        optimizer.build(variables)
    fresh = type(optimizer).from_config(optimizer.get_config())
    fresh.build(variables)
    for variable, initial in zip(optimizer.variables, fresh.variables):
        variable.assign(ops.convert_to_numpy(initial))
    if learning_rate is not None:
        optimizer.learning_rate = learning_rate
