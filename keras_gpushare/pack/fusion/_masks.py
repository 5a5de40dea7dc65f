"""Keras masks in member graphs: which call arguments and graph nodes only carry masks.

Keras computes masks (`Embedding(mask_zero=True)`, `Masking`) alongside the tensors and
passes them to the layers that take a `mask` (or `query_mask`, `value_mask`, ...) argument.
In a Functional graph these masks show up as explicit call arguments and as `keras.ops`
nodes (`not_equal`, `any`, ...) that compute them. The fused graph recomputes every mask
with the fused layers' own `compute_mask` (stacked like the tensor it belongs to), so the
converter drops these arguments and skips these nodes.
"""

import functools
import inspect

import keras
from keras import KerasTensor

from keras_gpushare import _upstream


def keras_mask(x):
    """The Keras mask attached to `x`, or `None`."""
    return _upstream.keras_mask(x) if isinstance(x, KerasTensor) else None


@functools.cache
def _method_signature(function):
    """The signature of a method `function` bound to an instance (its first parameter left
    out), as `inspect.signature` gives it; read once per function."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def call_signature(layer):
    """The signature of `layer.call`, read once per class's `call` (a planner reads it for
    every node of every member)."""
    call = layer.call
    if getattr(call, "__self__", None) is layer and inspect.isfunction(call.__func__):
        return _method_signature(call.__func__)
    return inspect.signature(call)


def _bound_arguments(node):
    layer = node.operation
    try:
        signature = call_signature(layer)
        return signature.bind(*node.arguments.args, **node.arguments.kwargs).arguments
    except (TypeError, ValueError):
        return {}


def _same_leaves(value, source):
    masks = keras.tree.flatten(keras.tree.map_structure(keras_mask, source))
    leaves = keras.tree.flatten(value)
    return len(masks) == len(leaves) and all(a is b for a, b in zip(leaves, masks))


def implicit_mask_kwargs(node):
    """Names of the call's keyword arguments that hold the masks Keras filled in.

    Keras fills `mask` from the only tensor argument's mask, and `<name>_mask` from the
    mask of the tensor argument `<name>` when there are several. An argument of that name
    holding anything else is an explicit mask the user passed (see `explicit_masks`).
    """
    if not isinstance(node.operation, keras.layers.Layer):
        return set()
    bound = _bound_arguments(node)
    found = set()
    for key, value in node.arguments.kwargs.items():
        source = _mask_source(key, bound)
        if value is not None and source is not None and _same_leaves(value, source):
            found.add(key)
    return found


def explicit_masks(node):
    """Names of mask arguments given explicitly rather than by Keras's propagation."""
    if not isinstance(node.operation, keras.layers.Layer):
        return set()
    bound = _bound_arguments(node)
    implicit = implicit_mask_kwargs(node)
    return {
        key
        for key, value in node.arguments.kwargs.items()
        if value is not None and key not in implicit and _is_mask_name(key, bound)
    }


def _is_mask_name(key, bound):
    return key == "mask" or (key.endswith("_mask") and key[: -len("_mask")] in bound)


def _tensor_arguments(bound, exclude):
    return {
        name: value
        for name, value in bound.items()
        if name != exclude and any(isinstance(x, KerasTensor) for x in keras.tree.flatten(value))
    }


def _mask_source(key, bound):
    """The argument whose mask Keras puts into argument `key`, or `None`."""
    if key == "mask":
        tensors = _tensor_arguments(bound, exclude=key)
        return next(iter(tensors.values())) if len(tensors) == 1 else None
    if key.endswith("_mask"):
        return bound.get(key[: -len("_mask")])
    return None


def mask_only_nodes(functional):
    """Ids of the `keras.ops` nodes of `functional` whose outputs only feed masks.

    Such a node's outputs are used only as masks Keras filled in, or by other such
    nodes, and are not model outputs.
    """
    outputs = {id(x) for x in keras.tree.flatten(functional.outputs)}
    uses = {}
    by_depth = _upstream.nodes_by_depth(functional)
    for depth in by_depth:
        for node in by_depth[depth]:
            if node.is_input or not node.operation:
                continue
            implicit = implicit_mask_kwargs(node)
            mask_ids = {
                id(x)
                for key in implicit
                for x in keras.tree.flatten(node.arguments.kwargs[key])
                if isinstance(x, KerasTensor)
            }
            for x in node.arguments.keras_tensors:
                uses.setdefault(id(x), []).append((node, id(x) in mask_ids))
    found = set()
    for depth in sorted(by_depth):
        for node in by_depth[depth]:
            if node.is_input or not node.operation:
                continue
            if isinstance(node.operation, keras.layers.Layer):
                continue
            if any(id(x) in outputs for x in node.outputs):
                continue
            consumers = [use for x in node.outputs for use in uses.get(id(x), [])]
            if consumers and all(as_mask or id(user) in found for user, as_mask in consumers):
                found.add(id(node))
    return found


def touches_masks(node):
    """Whether a layer call uses, passes on or makes a Keras mask in the member graph.

    A layer that neither supports masking nor takes a `mask` argument drops an incoming
    mask (Keras warns), which a fused form without mask handling does too.
    """
    layer = node.operation
    incoming = any(keras_mask(x) is not None for x in node.arguments.keras_tensors)
    uses = getattr(layer, "supports_masking", False) or _upstream.call_takes_mask(layer)
    outgoing = any(keras_mask(x) is not None for x in node.outputs)
    return (incoming and uses) or outgoing
