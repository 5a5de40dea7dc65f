"""Walk members' Keras graphs, compare them layer by layer, build the fused graph."""

import collections
import dataclasses
import inspect

import keras
from keras import KerasTensor

from keras_gpushare import _upstream
from keras_gpushare.pack.fusion import _masks, registry
from keras_gpushare.pack.fusion.layers_core import FusedBroadcast, FusedSkip, skip_name

_IGNORED_KEYS = ("name", "seed")


@dataclasses.dataclass
class MemberGraph:
    """One member's graph in a fixed order: its nodes, and its layers by position."""

    functional: keras.Model
    nodes: list
    layers: list
    tensor_refs: dict


_OWN_STEPS = ("call", "train_step", "test_step", "compute_loss", "compute_metrics")


def own_step_methods(model):
    """The training methods `model`'s class writes itself (a fused model would skip them).

    A Sequential or Functional model is fused from its layer graph and trained by the pack's
    own step, so a subclass that changes `call`, `train_step`, `compute_loss`, ... must not
    fuse; the graph engine runs it.
    """
    if isinstance(model, keras.Sequential):
        base = keras.Sequential
    elif _upstream.has_layer_graph(model):
        base = keras.Model
    else:
        return []
    return [
        name
        for name in _OWN_STEPS
        if getattr(type(model), name, None) is not getattr(base, name, None)
        and not (base is keras.Model and name == "call" and _functional_call(model))
    ]


def _functional_call(model):
    """Whether `model`'s `call` is Keras's Functional one (a plain Functional model)."""
    for cls in type(model).__mro__:
        if "call" in vars(cls):
            return _upstream.is_keras_builtin(cls)
    return True


def member_graph(model):
    """Return `(MemberGraph, None)` for a Sequential/Functional model, else `(None, why)`."""
    own = own_step_methods(model)
    if own:
        return None, (
            f"`{type(model).__name__}` writes its own {', '.join(f'`{m}`' for m in own)}; "
            "a fused model would run its layer graph with the pack's step instead"
        )
    if isinstance(model, keras.Sequential):
        functional = _upstream.sequential_graph(model)
        if functional is None:
            return None, (
                "Sequential model without a known input shape; start it with "
                "`keras.Input(shape)` or build it on data first"
            )
    elif isinstance(model, keras.Model) and _upstream.has_layer_graph(model):
        functional = model
    elif isinstance(model, keras.Model):
        return None, (
            f"subclassed model `{type(model).__name__}` has no layer graph to fuse; "
            "write it as a Sequential or Functional model"
        )
    else:
        return None, f"expected a `keras.Model`, got {type(model).__name__}"
    refs = {id(x): ("input", i) for i, x in enumerate(functional.inputs)}
    nodes, layers, seen = [], [], set()
    mask_only = _masks.mask_only_nodes(functional)
    by_depth = _upstream.nodes_by_depth(functional)
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if not node.operation or node.is_input or id(node) in mask_only:
                continue
            for j, out in enumerate(node.outputs):
                refs[id(out)] = ("node", len(nodes), j)
            nodes.append(node)
            if id(node.operation) not in seen:
                seen.add(id(node.operation))
                layers.append(node.operation)
    return MemberGraph(functional, nodes, layers, refs), None


def masked_outputs(functional):
    """Names of the outputs of `functional` that carry a Keras mask."""
    return [
        x.name for x in keras.tree.flatten(functional.outputs) if _masks.keras_mask(x) is not None
    ]


def fusion_signature(model):
    """A hashable summary that is equal for models that can fuse together, or `None`.

    Layer types, the configurations fusion compares (names, initializers, seeds and
    per-member keys such as a dropout rate or a regularizer's strength left out) and input
    shapes, in graph order.
    Grouping models by it (as the parallel tuner does) puts fusable ones together; the
    `fusion_report` of a group still has the last word.
    """
    graph, why = member_graph(model)
    return None if why else graph_signature(graph)


def graph_signature(graph):
    """`fusion_signature` of a member already read: `graph` is its `MemberGraph`."""
    signature = []
    for node in graph.nodes:
        layer = node.operation
        fused_class = registry.fused_form(type(layer))
        keys = (
            (*fused_class.per_member_keys, *fused_class.regularizer_keys)
            if fused_class is not None
            else ()
        )
        config = comparable_config(layer.get_config(), keys)
        shapes = tuple(tuple(x.shape) for x in node.input_tensors)
        signature.append((type(layer).__name__, repr(sorted(config.items())), shapes))
    return tuple(signature)


def comparable_config(config, per_member_keys=()):
    """A layer config without the keys that may differ across fusable members.

    The dtype policy is compared by name: a policy read back from a `.keras` file may be
    serialized differently (shared-object references) while being the same policy. Layers
    nested in a wrapper's config (`Bidirectional`, `TimeDistributed`) are compared the
    same way.
    """
    result = {
        key: _comparable_value(value)
        for key, value in config.items()
        if key not in _IGNORED_KEYS
        and key not in per_member_keys
        and not key.endswith("_initializer")
    }
    if "dtype" in result:
        result["dtype"] = keras.DTypePolicy(_policy_name(config["dtype"])).name
    return result


def _comparable_value(value):
    """A nested serialized object (`{"class_name": ..., "config": {...}}`) made comparable.

    The `shared_object_id` Keras adds while it saves or loads a file (a regularizer, say)
    names the Python object, not what it computes, so it is left out.
    """
    if isinstance(value, dict) and "class_name" in value and isinstance(value.get("config"), dict):
        value = {k: v for k, v in value.items() if k != "shared_object_id"}
        return {**value, "config": comparable_config(value["config"])}
    return value


def _policy_name(dtype):
    if isinstance(dtype, dict):
        return dtype.get("config", {}).get("name", "float32")
    return getattr(dtype, "name", dtype) or "float32"


def node_problem(nodes):
    """Why these members' calls (`None` for a member that skips it) cannot be one fused
    call (a sentence), or `None`; and the fused class."""
    present = [(i, node) for i, node in enumerate(nodes) if node is not None]
    node = present[0][1]
    layer = node.operation
    classes = {type(n.operation) for _, n in present}
    if len(classes) > 1:
        names = ", ".join(sorted(c.__name__ for c in classes))
        return f"different layer types across members: {names}", None
    if isinstance(layer, keras.Model):
        return "nested model; fusion needs its layers inline (flatten the model)", None
    if not isinstance(layer, keras.layers.Layer):
        return (
            f"`{type(layer).__name__}` is a `keras.ops` call in the graph, not a layer; "
            "use the matching layer (e.g. `keras.layers.Add`)",
            None,
        )
    fused_class = registry.fused_form(type(layer))
    if fused_class is None:
        return (
            f"layer type `{type(layer).__name__}` has no fused form; register one with "
            "`keras_gpushare.register_fused_layer`",
            None,
        )
    keys = fused_class.member_keys()
    configs = [(i, other.operation.get_config()) for i, other in present]
    for _, config in configs:
        reason = fused_class.unsupported_reason(config)
        if reason:
            return reason, fused_class
    base = comparable_config(configs[0][1], keys)
    for i, config in configs[1:]:
        other_config = comparable_config(config, keys)
        if other_config != base:
            differ = sorted(
                k for k in set(base) | set(other_config) if base.get(k) != other_config.get(k)
            )
            return f"config differs in member {i}: {', '.join(differ)}", fused_class
    reason = _inputs_problem(present)
    if reason:
        return reason, fused_class
    reason = call_problem(node, fused_class)
    if reason:
        return reason, fused_class
    if _masks.touches_masks(node) and not fused_class.handles_masks:
        return (
            "uses or makes a Keras mask (from `Embedding(mask_zero=True)` or `Masking`); "
            f"the fused form `{fused_class.__name__}` does not handle masks",
            fused_class,
        )
    skipped = [i for i, n in enumerate(nodes) if n is None]
    if skipped and not keeps_shape(node, fused_class):
        return (
            f"members {skipped} leave this layer out, and only layers that keep their "
            "input's shape (Dense, Dropout, normalization, activations) may be left out",
            fused_class,
        )
    return None, fused_class


def keeps_shape(node, fused_class):
    """Whether a member may leave this call out: its fused form allows it, and the call
    keeps its input's shape (all but the features)."""
    if fused_class is None or not fused_class.skippable:
        return False
    if len(node.input_tensors) != 1 or len(node.outputs) != 1:
        return False
    return tuple(node.input_tensors[0].shape[:-1]) == tuple(node.outputs[0].shape[:-1])


def _inputs_problem(present):
    """Why the members' calls take inputs too different to fuse, or `None`.

    The first argument's features (last axis) may differ in size (padding); every other
    dimension, and every other argument, must agree.
    """

    def shapes(n):
        first, others = call_arguments(n) or (None, {})
        lead = [tuple(x.shape[:-1]) for x in keras.tree.flatten(first) if hasattr(x, "shape")]
        rest = [tuple(x.shape) for x in keras.tree.flatten(others) if isinstance(x, KerasTensor)]
        return lead, rest, [x.dtype for x in n.input_tensors]

    reference = shapes(present[0][1])
    for i, other in present[1:]:
        if shapes(other) != reference:
            return f"input shapes or dtypes differ in member {i}"
    return None


def call_arguments(node):
    """A member layer call as `(first, others)`, or `None` when it cannot be read.

    `first` is the value of the call's first parameter (the input whose layout, stacked
    or replicated, a fused layer is told), `others` the other arguments given, by name,
    leaving out `None`s and the masks Keras fills in from the tensors' own masks.
    """
    try:
        bound = _masks.call_signature(node.operation).bind(
            *node.arguments.args, **node.arguments.kwargs
        )
    except (TypeError, ValueError):
        return None
    values = list(bound.arguments.items())
    if not values:
        return None
    implicit = _masks.implicit_mask_kwargs(node)
    others = {
        name: value for name, value in values[1:] if value is not None and name not in implicit
    }
    return values[0][1], others


def call_problem(node, fused_class):
    """Why the fused form cannot be called as the member layer is, or `None`."""
    explicit = _masks.explicit_masks(node)
    if explicit:
        return (
            f"called with an explicit `{sorted(explicit)[0]}`; fused layers take the masks "
            "Keras propagates (`Embedding(mask_zero=True)`, `Masking`), not masks passed by "
            "hand"
        )
    arguments = call_arguments(node)
    if arguments is None:
        return "its call arguments do not match its `call` signature"
    parameters = list(inspect.signature(fused_class.call).parameters.values())[1:]
    names = {p.name for p in parameters}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    extra = sorted(name for name in arguments[1] if name not in names)
    if extra:
        return (
            f"called with {', '.join(f'`{name}`' for name in extra)}, which the fused form "
            f"`{fused_class.__name__}` does not take"
        )
    return None


def _may_skip(node, x, y):
    """Whether a member may leave out this chain call, passing `x` on instead of `y`,
    with no wider tensor after it than the fused call's own output."""
    fused_class = registry.fused_form(type(node.operation))
    return keeps_shape(node, fused_class) and x.shape[-1] <= y.shape[-1]


def _fused_inputs(functional, n_members, stacked_inputs):
    """The fused model's inputs, one per input of the template's `functional`: each with
    a leading member axis when `stacked_inputs`, else the members' own shape."""
    new_inputs = []
    for x in functional.inputs:
        member_shape = tuple(x.shape[1:])
        name = _upstream.producing_layer(x).name
        if stacked_inputs:
            new = keras.Input(
                batch_shape=(n_members, None, *member_shape), dtype=x.dtype, name=name
            )
        else:
            new = keras.Input(shape=member_shape, dtype=x.dtype, name=name)
        new_inputs.append(new)
    return new_inputs


def _template_positions(graphs, template):
    """For each member, its nodes' positions in `MemberGraph.nodes` mapped to their
    template call."""
    index_of = [{id(n): k for k, n in enumerate(g.nodes)} for g in graphs]
    positions = [{} for _ in graphs]
    for t, tnode in enumerate(template):
        for i, n in enumerate(tnode.nodes):
            if n is not None:
                positions[i][index_of[i][id(n)]] = t
    return positions


def _fused_layer(tnode, n_members, flags, layouts, taken, capacity, settings):
    """The fused layer for template call `tnode`, made from every member's layer, told
    which of its inputs are stacked (`flags`), their layouts, what it holds beyond its
    members (`capacity`, built for slots) and how it holds their settings (`settings`,
    for a class that can hold them as data), and named apart from the names in `taken`."""
    layer = tnode.first.operation
    fused_class = registry.fused_form(type(layer))
    stacked_flags = flags if len(flags) > 1 else flags[0]
    member_layers = [None if n is None else n.operation for n in tnode.nodes]
    extra = {"capacity": capacity} if capacity else {}
    if settings.holds(fused_class):
        extra["settings"] = settings
    fused = fused_class.from_member(
        layer, n_members, stacked_flags, member_layers, input_layouts=layouts, **extra
    )
    # Aligned members of different depths can bring two layers of one name.
    base, k = fused.name, 1
    while fused.name in taken:
        fused.name, k = f"{base}_{k}", k + 1
    return fused


def build_graph(plan, n_members, input_mode):
    """Build the fused model's Functional graph from a `FusionPlan`; return it and a map.

    Each call of the plan's template becomes one fused layer, made from every member's
    layer (for `per_member_keys` and `size_keys`) and told its inputs' layouts. A member
    that leaves a call out gets its input passed through (`FusedSkip`). Built for slots,
    every call a member may leave out without widening what follows gets a `FusedSkip`, so
    that a model of another depth can be loaded into a slot (`FusedModel.slot_layers`).

    The map takes each fused layer's name to the position of the member layer it fuses in
    each member's `MemberGraph.layers` (`None` for a member that leaves it out).
    """
    graphs, template = plan.graphs, plan.template
    functional = graphs[0].functional
    settings = plan.settings
    # Held settings: a slot may take a model of another depth, leaving out any call it can.
    slots_skip = plan.chain and settings.held
    stacked_inputs = input_mode == "stacked"
    new_inputs = _fused_inputs(functional, n_members, stacked_inputs)
    tensors = {("input", i): new for i, new in enumerate(new_inputs)}
    stacked = {("input", i): stacked_inputs for i in range(len(new_inputs))}
    uses = collections.Counter(id(tnode.first.operation) for tnode in template)
    broadcasts = {}

    def stacked_tensor(key):
        """The fused tensor `key`, broadcast to the member axis if it is replicated."""
        if stacked[key]:
            return tensors[key]
        if key not in broadcasts:
            broadcasts[key] = FusedBroadcast(n_members, {})(tensors[key])
        return broadcasts[key]

    positions = _template_positions(graphs, template)

    def key_of(member, x):
        """The fused tensor standing for member `member`'s tensor `x`."""
        ref = graphs[member].tensor_refs[id(x)]
        if ref[0] == "input":
            return ("input", ref[1])
        return ("node", positions[member][ref[1]], ref[2])

    fused_layers, layer_index = {}, {}
    input_names = {x.name for x in new_inputs}
    for t, tnode in enumerate(template):
        node = tnode.first
        member = tnode.nodes.index(node)
        layer = node.operation
        first, others = call_arguments(node)
        shared = uses[id(layer)] > 1
        sources = plan.sources(t)
        # Only the first argument may stay replicated (the layer is told which of its
        # tensors are); every other tensor argument is stacked.
        leaves = keras.tree.flatten(first)
        keys = iter(sources)
        filled = [
            (stacked_tensor(next(keys)) if shared else tensors[next(keys)])
            if isinstance(x, KerasTensor)
            else x
            for x in leaves
        ]
        inputs = keras.tree.pack_sequence_as(first, filled)
        others = keras.tree.map_structure(
            lambda x, m=member: stacked_tensor(key_of(m, x)) if isinstance(x, KerasTensor) else x,
            others,
        )
        flags = [shared or stacked[key] for key in sources]
        fused = fused_layers.get(id(layer))
        if fused is None:
            layouts = [plan.layouts.get(key) for key in sources]
            taken = {*layer_index, *input_names}
            fused = _fused_layer(
                tnode, n_members, flags, layouts, taken, plan.capacity.get(t), settings
            )
            fused_layers[id(layer)] = fused
            layer_index[fused.name] = [
                None if n is None else graphs[i].layers.index(n.operation)
                for i, n in enumerate(tnode.nodes)
            ]
        outputs = keras.tree.flatten(fused(inputs, **others))
        skips = bool(tnode.skipped) or (
            slots_skip
            and fused.output_stacked
            and _may_skip(tnode.first, tensors[sources[0]], outputs[0])
        )
        if skips:
            present = [n is not None for n in tnode.nodes]
            skip = FusedSkip(
                n_members, {"present": present}, name=skip_name(fused.name), settings=settings
            )
            outputs[0] = skip([stacked_tensor(sources[0]), outputs[0]])
        for j, new in enumerate(outputs):
            tensors[("node", t, j)] = new
            stacked[("node", t, j)] = fused.output_stacked or skips
    if plan.chain:
        ends = [("node", len(template) - 1, 0)]
    else:
        ends = [key_of(0, x) for x in functional.outputs]
    outputs = [stacked_tensor(key) for key in ends]
    inputs = keras.tree.pack_sequence_as(_upstream.inputs_struct(functional), new_inputs)
    outputs = keras.tree.pack_sequence_as(_upstream.outputs_struct(functional), outputs)
    model = keras.Model(inputs, outputs, name=f"fused_{functional.name}")
    return model, layer_index
