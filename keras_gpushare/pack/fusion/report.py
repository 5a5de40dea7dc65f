"""`fusion_report`: can these members be fused, and why not, layer by layer."""

import dataclasses
from collections.abc import Sequence

import keras
from keras import KerasTensor

from keras_gpushare import _upstream
from keras_gpushare.pack.fusion import converter
from keras_gpushare.pack.fusion import layout as layout_lib
from keras_gpushare.pack.fusion import settings as settings_lib
from keras_gpushare.pack.fusion import template as template_lib
from keras_gpushare.pack.fusion._capacity import template_capacity


@dataclasses.dataclass
class LayerVerdict:
    """One layer call of the fused model and what fusion makes of it."""

    name: str
    type: str
    form: str
    reason: str | None = None
    skipped: list = dataclasses.field(default_factory=list)
    padding: float = 0.0


@dataclasses.dataclass
class FusionReport:
    """Whether N members can be fused, with a layer-by-layer account.

    Attributes:
        layers: One `LayerVerdict` per layer call of the fused model, in graph order.
        problems: Model-level reasons (not a graph, different inputs or outputs, ...).
        n_members: Number of members examined.
        member_ids: The members' numbers in a pack, to name them by (default: 0 to N-1).
    """

    layers: list = dataclasses.field(default_factory=list)
    problems: list = dataclasses.field(default_factory=list)
    n_members: int = 0
    member_ids: list | None = None

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
                if not v.reason and v.padding:
                    what += f", {v.padding:.0%} of its outputs padding"
                if not v.reason and v.skipped:
                    ids = self.member_ids or range(self.n_members)
                    skipped = ", ".join(str(ids[i]) for i in v.skipped)
                    what += f", left out by members {skipped}"
                lines.append(f"  {v.name:<{width}}  {v.type:<{type_width}}  {what}")
        return "\n".join(lines)


@dataclasses.dataclass
class FusionPlan:
    """How the members fuse: their graphs, the template of calls, and the tensors' layouts.

    Attributes:
        graphs: every member's `MemberGraph`.
        template: the fused model's calls (`template.TemplateNode`s).
        chain: whether the template aligns chains (a call's input is the previous call's
            output) rather than identical graphs.
        layouts: the layout of every fused tensor (`None` where no member pads it), by
            `("input", i)` or `("node", template position, output index)`.
        capacity: built for slots, what each searched call holds beyond its members, by
            template position (`_capacity.template_capacity`).
        settings: how the fused layers hold their members' settings (`settings.CONSTANTS`
            or `settings.HELD`).
    """

    graphs: list
    template: list
    chain: bool
    layouts: dict
    capacity: dict = dataclasses.field(default_factory=dict)
    settings: settings_lib.Settings = settings_lib.CONSTANTS

    def sources(self, t):
        """The keys of the tensors feeding call `t`'s first argument, flattened."""
        if self.chain:
            return [("input", 0)] if t == 0 else [("node", t - 1, 0)]
        node = self.template[t].nodes[0]
        graph = self.graphs[0]
        first, _ = converter.call_arguments(node)
        keys = []
        for x in keras.tree.flatten(first):
            if isinstance(x, KerasTensor):
                ref = graph.tensor_refs[id(x)]
                keys.append(("input", ref[1]) if ref[0] == "input" else ("node", ref[1], ref[2]))
        return keys


def _model_problems(graphs):
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
        if keras.tree.map_structure(lambda _: 0, _upstream.outputs_struct(other)) != (
            keras.tree.map_structure(lambda _: 0, _upstream.outputs_struct(first))
        ) or [tuple(x.shape) for x in other.outputs] != [tuple(x.shape) for x in first.outputs]:
            problems.append(f"member {i}'s outputs differ from member 0's (structure or shape)")
    return problems


def inspect_members(members, settings=settings_lib.CONSTANTS):
    """Return `(report, plan)`; `plan` (a `FusionPlan`) is `None` unless the members fuse.

    With `settings.HELD` (built for slots), chains are aligned as chains so that a model of
    another depth can be loaded later (`FusedModel.slot_layers`), and their searched calls
    share one capacity.
    """
    return inspect_graphs([converter.member_graph(model) for model in members], settings)


def inspect_graphs(read, settings=settings_lib.CONSTANTS):
    """`inspect_members` for members already read: `read` holds each member's
    `converter.member_graph` answer, `(graph, why)`, so that a member read once can be
    inspected in several sets (the planner's)."""
    report = FusionReport(n_members=len(read))
    if len(read) == 0:
        report.problems.append("no members given; pass at least one model")
        return report, None
    graphs = []
    for i, (graph, why) in enumerate(read):
        if why:
            report.problems.append(f"member {i}: {why}")
        graphs.append(graph)
    if report.problems:
        return report, None
    report.problems.extend(_model_problems(graphs))
    template_nodes, why = template_lib.align(graphs)
    if why:
        report.problems.append(why)
        return report, None
    chain = any(n is None for t in template_nodes for n in t.nodes) or any(
        len(g.nodes) != len(graphs[0].nodes) for g in graphs
    )
    capacity: dict = {}
    if settings.held:
        chain = chain or all(template_lib.is_chain(g) for g in graphs)
        if chain:
            capacity = template_capacity(template_nodes)
    plan = FusionPlan(graphs, template_nodes, chain, {}, capacity, settings)
    n = len(read)
    for i in range(len(graphs[0].functional.inputs)):
        plan.layouts[("input", i)] = None
    for t, tnode in enumerate(template_nodes):
        node = tnode.first
        layer = node.operation
        reason, fused_class = converter.node_problem(tnode.nodes)
        verdict = LayerVerdict(
            layer.name,
            type(layer).__name__,
            fused_class.__name__ if fused_class is not None else "-",
            reason,
            skipped=tnode.skipped,
        )
        report.layers.append(verdict)
        outputs = [None] * len(node.outputs)
        if reason is None:
            layers = [None if m is None else m.operation for m in tnode.nodes]
            inputs = [plan.layouts.get(key) for key in plan.sources(t)]
            first, _ = converter.call_arguments(node)
            shapes = [
                tuple(x.shape) for x in keras.tree.flatten(first) if isinstance(x, KerasTensor)
            ]
            found, why = fused_class.output_layouts(layers, inputs, shapes)
            if why:
                verdict.reason = why
            else:
                if t in capacity:
                    found = [layout_lib.widen(found[0], capacity[t]["units"]), *found[1:]]
                outputs = list(found) + [None] * (len(node.outputs) - len(found))
                if tnode.skipped:
                    outputs[0] = _passed_through(outputs[0], inputs[0], tnode.skipped, n, node)
                verdict.padding = 0.0 if outputs[0] is None else layout_lib.waste(outputs[0])
        for j, value in enumerate(outputs):
            plan.layouts[("node", t, j)] = None if layout_lib.is_full(value) else value
    if report.fusable and not chain:
        ends = [plan.graphs[0].tensor_refs[id(x)] for x in graphs[0].functional.outputs]
        keys = [("input", r[1]) if r[0] == "input" else ("node", r[1], r[2]) for r in ends]
    else:
        keys = [("node", len(template_nodes) - 1, 0)] if report.fusable else []
    if any(plan.layouts.get(key) is not None for key in keys):
        report.problems.append("the members' outputs differ in size; they must be the same")
    return report, (plan if report.fusable else None)


def _passed_through(out_layout, in_layout, skipped, n, node):
    """The layout after a call some members leave out: theirs is the input's, widened."""
    out_size = node.outputs[0].shape[-1]
    in_size = node.input_tensors[0].shape[-1]
    out_layout = layout_lib.full(out_size, n) if out_layout is None else out_layout
    in_layout = layout_lib.full(in_size, n) if in_layout is None else in_layout
    size = max(out_layout.shape[1], in_layout.shape[1])
    result = layout_lib.widen(out_layout, size)
    result[skipped] = layout_lib.widen(in_layout, size)[skipped]
    return result


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
