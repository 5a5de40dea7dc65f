"""Balance policies: cut a model's layers, in topological order, into contiguous stages."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import keras

from keras_gpushare.placement import _costs, _graph

logger = logging.getLogger(__name__)

POLICIES = ("params", "flops", "memory", "time")


def layer_costs(
    model: keras.Model, layers: Sequence[keras.layers.Layer], policy: str, batch_size: int
) -> list[float]:
    """Returns one cost per layer under `policy` ("params", "flops", "memory" or "time")."""
    nodes: dict[str, list[Any]] = {}
    for node in _graph.ordered_nodes(model):
        nodes.setdefault(node.operation.name, []).append(node)
    if policy == "params":
        return [float(_costs.param_count(layer)) for layer in layers]
    if policy == "flops":
        return [_costs.flops(layer, nodes[layer.name]) for layer in layers]
    if policy == "memory":
        return [
            float(
                _costs.weight_bytes(layer) + _costs.activation_bytes(nodes[layer.name]) * batch_size
            )
            for layer in layers
        ]
    if policy == "time":
        return _costs.measure_times(nodes, layers, batch_size)
    raise ValueError(
        f"Invalid value for argument `balance`: {policy!r}. Expected one of {POLICIES}, "
        "a list of stage sizes such as [3, 5], or a list of the layer names that start "
        "each stage after the first."
    )


def partition(costs: Sequence[float], n_stages: int) -> list[int]:
    """Cuts `costs` into `n_stages` contiguous non-empty parts minimizing the largest sum.

    Returns the number of items in each part. Ties go to the cut whose parts have the
    most even item counts, so zero-cost layers (activations, reshapes) spread out.
    """
    n = len(costs)
    # A tiny per-item cost keeps weightless layers from piling onto one stage.
    eps = (max(costs, default=0.0) or 1.0) * 1e-6
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c + eps)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def assign_stages(
    model: keras.Model,
    n_stages: int,
    balance: str | Sequence[int] | Sequence[str],
    batch_size: int,
) -> dict[str, int]:
    """Returns the stage index of every layer of `model` under `balance`."""
    layers = _graph.ordered_layers(model)
    names = [layer.name for layer in layers]
    if n_stages > len(layers):
        raise ValueError(
            f"Invalid plan: {n_stages} devices for a model of {len(layers)} layers. Each "
            f"stage needs at least one layer; pass at most {len(layers)} devices."
        )
    if isinstance(balance, str):
        sizes = partition(layer_costs(model, layers, balance, batch_size), n_stages)
    else:
        sizes = _explicit_sizes(list(balance), names, n_stages)
    logger.info("Stage sizes (layers per stage): %s.", sizes)
    stages: dict[str, int] = {}
    start = 0
    for k, size in enumerate(sizes):
        for name in names[start : start + size]:
            stages[name] = k
        start += size
    return stages


def _explicit_sizes(balance: list[Any], names: list[str], n_stages: int) -> list[int]:
    if all(isinstance(b, int) for b in balance):
        if len(balance) != n_stages or sum(balance) != len(names) or min(balance) < 1:
            even = [len(names) // n_stages + (k < len(names) % n_stages) for k in range(n_stages)]
            raise ValueError(
                f"Invalid value for argument `balance`: {balance}. Expected {n_stages} "
                f"positive stage sizes summing to the model's {len(names)} layers, for "
                f"example balance={even}."
            )
        return balance
    if all(isinstance(b, str) for b in balance):
        unknown = [b for b in balance if b not in names]
        if unknown or len(balance) != n_stages - 1:
            raise ValueError(
                f"Invalid value for argument `balance`: {balance}. Expected the names of "
                f"the {n_stages - 1} layers that start stages 1..{n_stages - 1}, in order"
                + (f"; unknown layers {unknown}" if unknown else "")
                + f". The layers, in topological order: {names}."
            )
        starts = [0] + [names.index(b) for b in balance] + [len(names)]
        sizes = [b - a for a, b in zip(starts, starts[1:])]
        if min(sizes) < 1:
            raise ValueError(
                f"Invalid value for argument `balance`: {balance}. The layers must be in "
                f"topological order and distinct, and not the first layer '{names[0]}'."
            )
        return sizes
    raise ValueError(
        f"Invalid value for argument `balance`: {balance!r}. Expected one of {POLICIES}, "
        "a list of stage sizes (ints) or a list of layer names."
    )
