"""`fusion_report`: can these members be fused, and why not, layer by layer."""

import dataclasses
from collections.abc import Sequence

import keras

from keras_gpushare.pack.fusion import converter


@dataclasses.dataclass
class LayerVerdict:
    """One layer call of member 0's graph and what fusion makes of it."""

    name: str
    type: str
    form: str
    reason: str | None = None


@dataclasses.dataclass
class FusionReport:
    """Whether N members can be fused, with a layer-by-layer account.

    Attributes:
        layers: One `LayerVerdict` per layer call, in graph order.
        problems: Model-level reasons (not a graph, different inputs or outputs, ...).
        n_members: Number of members examined.
    """

    layers: list = dataclasses.field(default_factory=list)
    problems: list = dataclasses.field(default_factory=list)
    n_members: int = 0

    @property
    def fusable(self) -> bool:
        """`True` when no model-level problem and no layer reason stand in the way."""
        return not self.problems and all(v.reason is None for v in self.layers)

    def __str__(self):
        verdict = "fusable" if self.fusable else "not fusable"
        lines = [f"Fusion report for {self.n_members} members: {verdict}."]
        lines.extend(f"  model: {problem}" for problem in self.problems)
        if self.layers:
            width = max(len(v.name) for v in self.layers)
            type_width = max(len(v.type) for v in self.layers)
            for v in self.layers:
                what = f"cannot fuse: {v.reason}" if v.reason else v.form
                lines.append(f"  {v.name:<{width}}  {v.type:<{type_width}}  {what}")
        return "\n".join(lines)


def _model_problems(members, graphs):
    problems = []
    first = graphs[0].functional
    masked = converter.masked_outputs(first)
    if masked:
        problems.append(
            f"output {masked[0]} carries a Keras mask, which plain Keras applies to the "
            "loss and metrics (masked steps left out); the fused engine does not yet, so "
            "such members train on the graph engine"
        )
    for i, graph in enumerate(graphs[1:], start=1):
        other = graph.functional
        if len(other.inputs) != len(first.inputs) or any(
            tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype
            for a, b in zip(first.inputs, other.inputs)
        ):
            problems.append(f"member {i} has different inputs (shapes or dtypes) than member 0")
        if keras.tree.map_structure(lambda _: 0, other._outputs_struct) != (
            keras.tree.map_structure(lambda _: 0, first._outputs_struct)
        ):
            problems.append(f"member {i} has a different output structure than member 0")
        if len(graph.nodes) != len(graphs[0].nodes):
            problems.append(
                f"member {i} has {len(graph.nodes)} layer calls, member 0 has "
                f"{len(graphs[0].nodes)}"
            )
    return problems


def inspect_members(members):
    """Return `(report, graphs)`; `graphs` is `None` unless every member has a graph."""
    report = FusionReport(n_members=len(members))
    if len(members) == 0:
        report.problems.append("no members given; pass at least one model")
        return report, None
    graphs = []
    for i, model in enumerate(members):
        graph, why = converter.member_graph(model)
        if why:
            report.problems.append(f"member {i}: {why}")
        graphs.append(graph)
    if report.problems:
        return report, None
    report.problems.extend(_model_problems(members, graphs))
    count = min(len(g.nodes) for g in graphs)
    for k, node in enumerate(graphs[0].nodes[:count]):
        layer = node.operation
        members_nodes = [g.nodes[k] for g in graphs]
        reason, fused_class = converter.layer_problem(layer, node, members_nodes, graphs)
        form = fused_class.__name__ if fused_class is not None else "-"
        report.layers.append(LayerVerdict(layer.name, type(layer).__name__, form, reason))
    return report, graphs


def fusion_report(members: Sequence[keras.Model]) -> FusionReport:
    """Say whether `members` can be fused into one model, layer by layer.

    Members fuse when they are Sequential or Functional models with the same graph:
    the same layer types, input shapes, connections and configs, apart from names,
    initializers, seeds and weight values, and every layer has a registered fused form
    (see `register_fused_layer`).

    Args:
        members: The member models. Defaults to none (required).

    Returns:
        A `FusionReport`: `.fusable` and a readable `str(report)`.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion import fusion_report

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])

    report = fusion_report([build(), build()])
    print(report.fusable)  # True
    print(report)
    ```
    """
    report, _ = inspect_members(list(members))
    return report
