"""Walk members' Keras graphs, compare them layer by layer, build the fused graph."""

import dataclasses
import inspect

import keras
from keras.src.backend import KerasTensor

from keras_gpushare.pack.fusion import _masks, registry
from keras_gpushare.pack.fusion.layers_core import FusedBroadcast

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
    elif hasattr(model, "_nodes_by_depth"):
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
            return cls.__module__.startswith("keras.src.")
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
        functional = getattr(model, "_functional", None)
        if functional is None:
            return None, (
                "Sequential model without a known input shape; start it with "
                "`keras.Input(shape)` or build it on data first"
            )
    elif isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth"):
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
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
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
    per-member keys such as a dropout rate left out) and input shapes, in graph order.
    Grouping models by it (as the parallel tuner does) puts fusable ones together; the
    `fusion_report` of a group still has the last word.
    """
    graph, why = member_graph(model)
    if why:
        return None
    signature = []
    for node in graph.nodes:
        layer = node.operation
        fused_class = registry.fused_form(type(layer))
        keys = fused_class.per_member_keys if fused_class is not None else ()
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
        result["dtype"] = keras.DTypePolicy(_policy_name(result["dtype"])).name
    return result


def _comparable_value(value):
    """A nested serialized layer (`{"class_name": ..., "config": {...}}`) made comparable."""
    if isinstance(value, dict) and "class_name" in value and isinstance(value.get("config"), dict):
        return {**value, "config": comparable_config(value["config"])}
    return value


def _policy_name(dtype):
    if isinstance(dtype, dict):
        return dtype.get("config", {}).get("name", "float32")
    return getattr(dtype, "name", dtype) or "float32"


def node_signature(graph, node):
    """Everything about a call that must match across members, apart from weights."""
    refs = {key: value for key, value in graph.tensor_refs.items()}
    args, kwargs = node.arguments.fill_in(refs)
    return {
        "arguments": (args, kwargs),
        "input_shapes": [tuple(x.shape) for x in node.input_tensors],
        "input_dtypes": [x.dtype for x in node.input_tensors],
    }


def layer_problem(layer, node, members_nodes, members_graphs):
    """Why this node cannot be fused (a sentence), or `None`; and its fused class."""
    classes = {type(n.operation) for n in members_nodes}
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
    config = layer.get_config()
    reason = fused_class.unsupported_reason(config)
    if reason:
        return reason, fused_class
    base = comparable_config(config, fused_class.per_member_keys)
    for i, other in enumerate(members_nodes[1:], start=1):
        other_config = comparable_config(other.operation.get_config(), fused_class.per_member_keys)
        if other_config != base:
            keys = sorted(
                k for k in set(base) | set(other_config) if base.get(k) != other_config.get(k)
            )
            return f"config differs in member {i}: {', '.join(keys)}", fused_class
    signature = node_signature(members_graphs[0], node)
    for i, (graph, other) in enumerate(zip(members_graphs[1:], members_nodes[1:]), start=1):
        other_signature = node_signature(graph, other)
        for key in ("input_shapes", "input_dtypes", "arguments"):
            if other_signature[key] != signature[key]:
                what = {
                    "input_shapes": f"input shapes differ in member {i}: "
                    f"{signature['input_shapes']} vs {other_signature['input_shapes']}",
                    "input_dtypes": f"input dtypes differ in member {i}",
                    "arguments": f"connections or call arguments differ in member {i}",
                }
                return what[key], fused_class
        shapes = [tuple(w.shape) for w in layer.weights]
        if [tuple(w.shape) for w in other.operation.weights] != shapes:
            return f"weight shapes differ in member {i}", fused_class
    reason = call_problem(node, fused_class)
    if reason:
        return reason, fused_class
    if _masks.touches_masks(node) and not fused_class.handles_masks:
        return (
            "uses or makes a Keras mask (from `Embedding(mask_zero=True)` or `Masking`); "
            f"the fused form `{fused_class.__name__}` does not handle masks",
            fused_class,
        )
    return None, fused_class


def call_arguments(node):
    """A member layer call as `(first, others)`, or `None` when it cannot be read.

    `first` is the value of the call's first parameter (the input whose layout, stacked
    or replicated, a fused layer is told), `others` the other arguments given, by name,
    leaving out `None`s and the masks Keras fills in from the tensors' own masks.
    """
    try:
        bound = inspect.signature(node.operation.call).bind(
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


def build_graph(graphs, n_members, input_mode):
    """Rebuild member 0's graph from fused layers; return the Functional model and a map.

    `graphs` holds every member's graph (member 0's first); the others give the values of
    the fused classes' `per_member_keys`.

    The map takes each fused layer's name to the position of the member layer it fuses
    in `MemberGraph.layers`.
    """
    graph = graphs[0]
    functional = graph.functional
    stacked_inputs = input_mode == "stacked"
    tensors, stacked = {}, {}
    new_inputs = []
    for x in functional.inputs:
        member_shape = tuple(x.shape[1:])
        name = x._keras_history.operation.name
        if stacked_inputs:
            new = keras.Input(
                batch_shape=(n_members, None, *member_shape), dtype=x.dtype, name=name
            )
        else:
            new = keras.Input(shape=member_shape, dtype=x.dtype, name=name)
        new_inputs.append(new)
        tensors[id(x)] = new
        stacked[id(x)] = stacked_inputs
    uses = {}
    for node in graph.nodes:
        uses[id(node.operation)] = uses.get(id(node.operation), 0) + 1
    broadcasts = {}

    def stacked_tensor(x):
        """The fused tensor for `x`, broadcast to the member axis if it is replicated."""
        if stacked[id(x)]:
            return tensors[id(x)]
        if id(x) not in broadcasts:
            broadcasts[id(x)] = FusedBroadcast(n_members, {})(tensors[id(x)])
        return broadcasts[id(x)]

    def fill(value, stack):
        if not isinstance(value, KerasTensor):
            return value
        return stacked_tensor(value) if stack else tensors[id(value)]

    fused_layers, layer_index = {}, {}
    for k, node in enumerate(graph.nodes):
        layer = node.operation
        first, others = call_arguments(node)
        shared = uses[id(layer)] > 1
        # Only the first argument may stay replicated (the layer is told which of its
        # tensors are); every other tensor argument is stacked.
        inputs = keras.tree.map_structure(lambda x, stack=shared: fill(x, stack), first)
        others = keras.tree.map_structure(lambda x: fill(x, True), others)
        flat = [x for x in keras.tree.flatten(first) if isinstance(x, KerasTensor)]
        flags = [shared or stacked[id(x)] for x in flat]
        fused = fused_layers.get(id(layer))
        if fused is None:
            fused_class = registry.fused_form(type(layer))
            stacked_flags = flags if len(flags) > 1 else flags[0]
            if fused_class.per_member_keys:
                member_layers = [g.nodes[k].operation for g in graphs]
                fused = fused_class.from_member(layer, n_members, stacked_flags, member_layers)
            else:
                fused = fused_class.from_member(layer, n_members, stacked_flags)
            fused_layers[id(layer)] = fused
            layer_index[fused.name] = graph.layers.index(layer)
        outputs = fused(inputs, **others)
        for out, new in zip(node.outputs, keras.tree.flatten(outputs)):
            tensors[id(out)] = new
            stacked[id(out)] = fused.output_stacked
    outputs = []
    for x in functional.outputs:
        out = tensors[id(x)]
        if not stacked[id(x)]:
            out = FusedBroadcast(n_members, {})(out)
        outputs.append(out)
    inputs = keras.tree.pack_sequence_as(functional._inputs_struct, new_inputs)
    outputs = keras.tree.pack_sequence_as(functional._outputs_struct, outputs)
    model = keras.Model(inputs, outputs, name=f"fused_{functional.name}")
    return model, layer_index
