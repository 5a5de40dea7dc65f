"""What a program built for slots holds beyond its first members: the template's capacity.

A pack built for slots (`settings.HELD`) takes later models into its slots when each of its
fused layers holds what the model needs: a `Dense` as wide, an activation among those it
computes. Built from its first members only, each layer holds just their widths and
activations, so a later trial of a search loop (`for i in range(hp.Int("num_layers", ...))`
with per-layer units and one activation hyperparameter) often misses by one layer: its third
layer wider, or with another activation, than the first members' third layers were, although
their first layers had both. The template then shares one capacity among its searched
`Dense` calls: the widest width any of them has and every elementwise activation any of them
uses. The last `Dense` (the output) and calls every member makes alike keep their own.

Widening costs every step of the program; opening another program costs one build and
compile. The capacity is taken only when the program's estimated FLOPs a step grow by at
most `MAX_WIDENING` (see `widening_cost`).
"""

from __future__ import annotations

from typing import Any

from keras_gpushare.pack.fusion import registry
from keras_gpushare.pack.fusion._checks import elementwise_activation

# The most a shared capacity may add to a program's FLOPs a step. On the 2-core CPU of
# docs/tuner.md, a program of 16 getting-started slots takes 1.5-3 s to build and compile
# against 1-1.5 s a steady epoch: over a search of a few epochs a trial, a quarter more a
# step costs about what one more program does.
MAX_WIDENING = 0.25


def template_capacity(template: list) -> dict[int, dict[str, Any]]:
    """The capacity of each searched call of a chain `template`: `{position: {"units":
    width, "activation": [specs]}}`, or `{}` when sharing one costs too much.

    Args:
        template: the template's calls (`template.TemplateNode`s), a chain.
    """
    dense = [t for t, tnode in enumerate(template) if _shares_capacity(tnode)]
    searched = [t for t in dense[:-1] if _searched(template[t])]
    if len(searched) < 2:
        return {}
    units = max(_units(template[t]) for t in searched)
    specs: dict[str, Any] = {}
    for t in searched:
        for layer in _layers(template[t]):
            spec = layer.get_config()["activation"]
            if elementwise_activation(spec):
                specs.setdefault(repr(spec), spec)
    capacity = {t: {"units": units, "activation": list(specs.values())} for t in searched}
    if widening_cost(template, capacity) > MAX_WIDENING:
        return {}
    return capacity


def widening_cost(template: list, capacity: dict[int, dict[str, Any]]) -> float:
    """How much `capacity` adds to a step's FLOPs of the `Dense` calls of a chain
    `template` (0.25: a quarter more), each call counted at its padded widths."""
    plain, widened = _dense_flops(template, {}), _dense_flops(template, capacity)
    return 0.0 if plain <= 0 else widened / plain - 1.0


def _dense_flops(template: list, capacity: dict[int, dict[str, Any]]) -> float:
    width, flops = None, 0.0
    for t, tnode in enumerate(template):
        nodes = [node for node in tnode.nodes if node is not None]
        if width is None:
            width = max(_last(node.input_tensors[0]) for node in nodes)
        if _shares_capacity(tnode):
            out = max(_units(tnode), capacity.get(t, {}).get("units", 0))
            flops += width * out
            width = out if not tnode.skipped else max(width, out)
        elif not all(node.outputs[0].shape == node.input_tensors[0].shape for node in nodes):
            width = max(_last(node.outputs[0]) for node in nodes)
    return flops


def _shares_capacity(tnode: Any) -> bool:
    fused_class = registry.fused_form(type(tnode.first.operation))
    return bool(getattr(fused_class, "template_capacity", False))


def _searched(tnode: Any) -> bool:
    """Whether members differ at this call (some leave it out, or their widths or
    activations differ) and every activation they use there acts feature by feature."""
    specs = [layer.get_config()["activation"] for layer in _layers(tnode)]
    if not all(elementwise_activation(spec) for spec in specs):
        return False
    configs = {(layer.units, repr(spec)) for layer, spec in zip(_layers(tnode), specs)}
    return bool(tnode.skipped) or len(configs) > 1


def _layers(tnode: Any) -> list:
    return [node.operation for node in tnode.nodes if node is not None]


def _units(tnode: Any) -> int:
    return max(int(layer.units) for layer in _layers(tnode))


def _last(x: Any) -> int:
    return int(x.shape[-1] or 1)
