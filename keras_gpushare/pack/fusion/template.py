"""The layer calls of a fused model, each with the member call it stands for.

Members that share a graph (the same layers, connected the same way) align call by call.
Members whose graphs are chains of layers (Sequential models, and Functional ones without
branches) may also differ in depth: KerasTuner's `for i in range(hp.Int("num_layers", ...))`
builds 1 to 3 hidden layers, an optional `Dropout` appears or not. Their calls are aligned
into one template, the shortest sequence that holds every member's calls in order; a member
leaves out the template calls it does not have, and the fused model passes that member's
tensor through them unchanged. Only calls that keep their input's shape can be left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from keras import KerasTensor

from keras_gpushare.pack.fusion import registry
from keras_gpushare.pack.fusion.converter import call_arguments, comparable_config, keeps_shape


@dataclasses.dataclass
class TemplateNode:
    """One call of the fused model: each member's node for it, `None` where a member skips."""

    nodes: list

    @property
    def first(self) -> Any:
        """The first member's node that makes this call."""
        return next(node for node in self.nodes if node is not None)

    @property
    def skipped(self) -> list[int]:
        """The members that leave this call out."""
        return [i for i, node in enumerate(self.nodes) if node is None]


def align(graphs: Sequence[Any]) -> tuple[list[TemplateNode] | None, str | None]:
    """The template of the members' graphs, or `(None, why they cannot align)`."""
    if _same_structure(graphs):
        count = len(graphs[0].nodes)
        return [TemplateNode([g.nodes[k] for g in graphs]) for k in range(count)], None
    chains = [chain for chain in map(_chain, graphs) if chain is not None]
    if len(chains) < len(graphs):
        return None, (
            "the members' layer graphs differ, and only members whose layers form one chain "
            "(Sequential, or Functional without branches) may differ in depth"
        )
    template = [TemplateNode([node]) for node in chains[0]]
    for i, chain in enumerate(chains[1:], start=1):
        merged = _merge(template, chain, i)
        if merged is None:
            return None, (
                f"member {i}'s layers cannot be lined up with the others': only layers that "
                "keep their input's shape (Dense, Dropout, normalization, activations) may be "
                "present in some members and not in others"
            )
        template = merged
    return template, None


def _same_structure(graphs: Sequence[Any]) -> bool:
    """Whether the members' graphs have the same calls, connected the same way."""
    first = graphs[0]
    for graph in graphs[1:]:
        if len(graph.nodes) != len(first.nodes):
            return False
        for a, b in zip(first.nodes, graph.nodes):
            if type(a.operation) is not type(b.operation):
                return False
            if _connections(first, a) != _connections(graph, b):
                return False
    return True


def _connections(graph: Any, node: Any) -> Any:
    args, kwargs = node.arguments.fill_in(graph.tensor_refs)
    return repr((args, sorted(kwargs.items())))


def is_chain(graph: Any) -> bool:
    """Whether the member's layer calls form one chain from its input to its output."""
    return _chain(graph) is not None


def _chain(graph: Any) -> list | None:
    """The member's nodes when they form one chain from the model's input, else `None`."""
    functional = graph.functional
    if len(functional.inputs) != 1 or len(functional.outputs) != 1:
        return None
    previous = functional.inputs[0]
    used = set()
    for node in graph.nodes:
        if id(node.operation) in used:
            return None
        used.add(id(node.operation))
        arguments = call_arguments(node)
        if arguments is None:
            return None
        first, others = arguments
        tensors = [x for x in _leaves(others) if isinstance(x, KerasTensor)]
        if first is not previous or tensors or len(node.outputs) != 1:
            return None
        previous = node.outputs[0]
    if graph.nodes and functional.outputs[0] is not previous:
        return None
    return list(graph.nodes)


def _leaves(value: Any) -> list:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _token(node: Any) -> Any:
    """What must be equal for two calls to be one template call (sizes left out)."""
    layer = node.operation
    fused_class = registry.fused_form(type(layer))
    keys = () if fused_class is None else fused_class.member_keys()
    config = comparable_config(layer.get_config(), keys)
    shape = tuple(node.input_tensors[0].shape[1:-1]) if node.input_tensors else ()
    return type(layer).__name__, repr(sorted(config.items())), shape


def _skippable(node: Any) -> bool:
    return keeps_shape(node, registry.fused_form(type(node.operation)))


def _similarity(a: Any, b: Any, config_a: dict, config_b: dict) -> int:
    """How alike two calls that may be one template call are (higher: more alike).

    Calls that read inputs of the same width come first: a shallower member's first
    hidden layer then lines up with the deeper members' first one (both read the model's
    input) rather than with a later layer of its own width, which would pad that later
    layer to the input's width. Then equal output widths, then the values that may differ
    between members (activation, `use_bias`).
    """
    fused_class = registry.fused_form(type(a.operation))
    if fused_class is None:
        return 0
    score = sum(config_a.get(k) == config_b.get(k) for k in fused_class.per_member_keys)
    if _width(a.input_tensors) == _width(b.input_tensors):
        score += 4
    if _width(a.outputs) == _width(b.outputs):
        score += 1
    return score


def _width(tensors: Sequence[Any]) -> Any:
    return tensors[0].shape[-1] if tensors else None


def _merge(template: list[TemplateNode], chain: list, member: int) -> list[TemplateNode] | None:
    """The template extended by member `member`'s chain (the most calls in common).

    Dynamic programming over suffixes: `best[a][b]` scores the best alignment of
    `template[a:]` with `chain[b:]` (matched calls first, then how alike the matched calls
    are, `_similarity`, with the chains' last calls, the outputs, lined up before that),
    `-1` where none exists. The alignment is read from the start, matching as early as
    possible among the best, so a shallower member's hidden layers line up with the deeper
    members' first ones and output layers with outputs.
    """
    t_tokens = [_token(node.first) for node in template]
    c_tokens = [_token(node) for node in chain]
    t_configs = [node.first.operation.get_config() for node in template]
    c_configs = [node.operation.get_config() for node in chain]
    t_skip = [_skippable(node.first) for node in template]
    c_skip = [_skippable(node) for node in chain]
    n, m = len(template), len(chain)

    def match(a: int, b: int) -> int:
        if t_tokens[a] != c_tokens[b]:
            return -1
        # The chains' last calls (the models' outputs) line up before anything else does.
        last = 8 if (a, b) == (n - 1, m - 1) else 0
        return 1000 + last + _similarity(template[a].first, chain[b], t_configs[a], c_configs[b])

    best = [[-1] * (m + 1) for _ in range(n + 1)]
    best[n][m] = 0
    for a in range(n, -1, -1):
        for b in range(m, -1, -1):
            if a == n and b == m:
                continue
            options = []
            if a < n and b < m and match(a, b) >= 0 and best[a + 1][b + 1] >= 0:
                options.append(best[a + 1][b + 1] + match(a, b))
            if a < n and t_skip[a] and best[a + 1][b] >= 0:
                options.append(best[a + 1][b])
            if b < m and c_skip[b] and best[a][b + 1] >= 0:
                options.append(best[a][b + 1])
            best[a][b] = max(options, default=-1)
    if best[0][0] < 0:
        return None
    merged, a, b = [], 0, 0
    while a < n or b < m:
        target = best[a][b]
        if a < n and b < m and match(a, b) >= 0 and best[a + 1][b + 1] == target - match(a, b):
            merged.append(TemplateNode([*template[a].nodes, chain[b]]))
            a, b = a + 1, b + 1
        elif b < m and c_skip[b] and best[a][b + 1] == target:
            merged.append(TemplateNode([None] * member + [chain[b]]))
            b += 1
        else:
            merged.append(TemplateNode([*template[a].nodes, None]))
            a += 1
    return merged


def skeleton(graph: Any) -> Any:
    """A summary equal for members that may fuse into one template (sizes left out).

    For chains, the calls no member may leave out (those that change the shape), in order;
    for other graphs, every call and its connections.
    """
    functional = graph.functional
    ends = tuple((tuple(x.shape), str(x.dtype)) for x in [*functional.inputs, *functional.outputs])
    chain = _chain(graph)
    if chain is not None:
        return "chain", ends, tuple(_token(node) for node in chain if not _skippable(node))
    calls = tuple((_token(node), _connections(graph, node)) for node in graph.nodes)
    return "graph", ends, calls


def padded_signature(graph: Any) -> Any:
    """A summary equal for members whose calls and connections all agree but for the
    values that may differ between fused members (sizes, activations, regularizers).

    Members with equal signatures usually fuse together; the planner tries them as one
    class before it splits members that do not fuse as a whole.
    """
    functional = graph.functional
    ends = tuple((tuple(x.shape), str(x.dtype)) for x in [*functional.inputs, *functional.outputs])
    return ends, tuple((_token(node), _connections(graph, node)) for node in graph.nodes)
