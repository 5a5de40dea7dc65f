"""`FusedModel`: N same-architecture members as one model with stacked weights."""

import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gpushare.pack.fusion import converter, registry
from keras_gpushare.pack.fusion.base import members_loaded_after
from keras_gpushare.pack.fusion.layers_core import FusedSkip
from keras_gpushare.pack.fusion.report import inspect_members

logger = logging.getLogger(__name__)

_INPUT_MODES = ("replicate", "stacked")


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedModel(keras.Model):
    """N members' copies of one architecture, computed as one model.

    Every weight carries a leading member axis N. With `input_mode="replicate"` each
    input is `(B, ...)` and shared by all members; with `"stacked"` it is `(N, b, ...)`,
    member i's own batch in slice i. Outputs have member 0's output structure, every
    leaf stacked to `(N, B, ...)`. Build one with `build_fused_model`.

    Args:
        graph: The Functional model of fused layers. Defaults to none (required).
        n_members: Number of members N. Defaults to none (required).
        input_mode: `"replicate"` or `"stacked"`. Defaults to `"replicate"`.
        layer_index: Maps each fused layer's name to the position of the member layer
            it fuses in the member's graph order. Defaults to none (required).
        **kwargs: Base model keyword arguments (`name`, `trainable`).

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion import build_fused_model

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])

    members = [build() for _ in range(3)]
    fused = build_fused_model(members)
    print(fused(keras.ops.ones((5, 4))).shape)  # (3, 5, 2)
    ```
    """

    def __init__(self, graph, n_members, input_mode="replicate", layer_index=None, **kwargs):
        super().__init__(**kwargs)
        self.graph = graph
        self.n_members = int(n_members)
        self.input_mode = input_mode
        self.layer_index = dict(layer_index or {})
        self.built = True

    def call(self, inputs, training=None):
        return self.graph(inputs, training=training)

    @property
    def xla_pays_on_cpu(self) -> bool:
        """Whether XLA pays for this model on a CPU: no fused layer says otherwise."""
        return all(getattr(layer, "xla_pays_on_cpu", True) for layer in self.graph.layers)

    def member_variable_map(self, members: Sequence[keras.Model]) -> list:
        """Pair every fused variable with the member variables it stacks.

        Args:
            members: The N member models, structured like those the model was built
                from. Defaults to none (required).

        Returns:
            A list of `(fused_variable, parts)`, trainable and non-trainable variables
            alike, in the order of `self.weights`. `parts[i]` is `(variable, index)`:
            member `i`'s variable (`None` when the member has none: it leaves the layer
            out, or has no bias) and where it lies in slice `i` of the fused variable
            (`index`, a tuple of per-axis positions for `member_part`; `None`: the whole
            slice).
        """
        members = list(members)
        if len(members) != self.n_members:
            raise ValueError(
                f"Invalid value for argument `members`: got {len(members)} models for a "
                f"fused model of {self.n_members} members. Pass the {self.n_members} "
                "members it was built from."
            )
        graphs = []
        for i, member in enumerate(members):
            graph, why = converter.member_graph(member)
            if why:
                raise ValueError(f"Member {i} cannot be mapped onto the fused model: {why}.")
            graphs.append(graph)
        pairs = []
        for layer in self.graph.layers:
            positions = self.layer_index.get(layer.name)
            if positions is None:
                continue
            if isinstance(positions, int):
                positions = [positions] * self.n_members
            member_layers = [None if p is None else g.layers[p] for g, p in zip(graphs, positions)]
            for k, fused_variable in enumerate(layer.weights):
                parts = []
                for i, member_layer in enumerate(member_layers):
                    position, index = (None, None)
                    if member_layer is not None:
                        position, index = layer.member_weight_index(k, i)
                    variable = None if position is None else member_layer.weights[position]
                    if variable is not None:
                        _check_part(variable, fused_variable, index, i)
                    parts.append((variable, index))
                pairs.append((fused_variable, tuple(parts)))
        return pairs

    def load_from_members(self, members: Sequence[keras.Model]) -> None:
        """Copy every member's weights into its slice of the stacked weights.

        Padding (what no member owns) is set to zero.

        Args:
            members: The N member models. Defaults to none (required).
        """
        for fused_variable, parts in self.member_variable_map(members):
            if all(variable is None for variable, _ in parts):
                continue  # The layer's own (the settings a slot holds), not the members'.
            value = np.zeros(fused_variable.shape, dtype=fused_variable.dtype)
            for i, (variable, index) in enumerate(parts):
                if variable is not None:
                    set_member_part(value, i, index, ops.convert_to_numpy(variable))
            fused_variable.assign(value)

    @property
    def holds_slots(self) -> bool:
        """Whether some fused layer holds its members' settings as data (`slot_values`)."""
        return any(getattr(layer, "slot_values", False) for layer in self.graph.layers)

    def slot_layers(self, model: keras.Model, member: keras.Model) -> tuple[list, str | None]:
        """`model`'s layer for each fused layer, when `model` can take a slot by values.

        It can when every fused layer with weights holds its members' settings as data
        (`FusedLayer.slot_values`), no member skips a layer, and `model`'s layers are this
        model's, call for call, each within what its fused layer holds.

        Args:
            model: the model to load.
            member: a model this fused model was built from (for the layers' classes).

        Returns:
            `(pairs, None)` with `(fused layer, model's layer)` pairs, or `([], why not)`.
        """
        graph, why = converter.member_graph(model)
        if why:
            return [], why
        reference, _ = converter.member_graph(member)
        pairs = []
        for layer in self.graph.layers:
            positions = self.layer_index.get(layer.name)
            if positions is None:
                if isinstance(layer, FusedSkip):
                    return [], "the slot's members differ in depth"
                continue
            if not isinstance(positions, int):
                if len(set(positions)) != 1:
                    return [], "the slot's members differ in depth"
                positions = positions[0]
            pairs.append((layer, positions))
        kinds = [type(layer).__name__ for layer in graph.layers]
        expected = [type(reference.layers[p]).__name__ for _, p in pairs]
        if len(graph.layers) != len(pairs) or any(
            kinds[p] != kind for (_, p), kind in zip(pairs, expected)
        ):
            return [], (
                f"its layers are {', '.join(kinds)}; the slot's members' {', '.join(expected)}"
            )
        pairs = [(layer, graph.layers[p]) for layer, p in pairs]
        for fused_layer, layer in pairs:
            if fused_layer.weights and not fused_layer.slot_values:
                return [], f"the slot's layer `{fused_layer.name}` holds its settings as constants"
            if any(
                value is not None
                for key in fused_layer.regularizer_keys
                for value in fused_layer.per_member(key)
            ):
                return [], f"the slot's layer `{fused_layer.name}` has weight regularizers"
            fused_class = registry.fused_form(type(layer))
            if fused_class is not type(fused_layer):
                return [], f"its layer `{layer.name}` is a `{type(layer).__name__}`"
            keys = fused_layer.slot_keys if fused_layer.slot_values else ()
            config = converter.comparable_config(layer.get_config(), keys)
            expected = converter.comparable_config(_member_config(fused_layer), keys)
            if config != expected:
                key = next(
                    k for k in sorted({*config, *expected}) if config.get(k) != expected.get(k)
                )
                return [], (
                    f"its layer `{layer.name}` sets `{key}={config.get(key)!r}` where the slot's "
                    f"has {expected.get(key)!r}"
                )
            problem = fused_layer.slot_problem(layer) if fused_layer.slot_values else None
            if problem:
                return [], problem
        return pairs, None

    def load_member(self, j: int, pairs: list) -> None:
        """Writes each model layer of `pairs` (from `slot_layers`) into slot `j`."""
        for fused_layer, layer in pairs:
            if fused_layer.slot_values:
                fused_layer.load_member(j, layer)

    def write_to_members(self, members: Sequence[keras.Model]) -> None:
        """Copy each slice of the stacked weights back into its member model.

        Non-trainable weights (BatchNormalization moving statistics) go back too.

        Args:
            members: The N member models. Defaults to none (required).
        """
        for fused_variable, parts in self.member_variable_map(members):
            value = ops.convert_to_numpy(fused_variable)
            for i, (variable, index) in enumerate(parts):
                if variable is not None:
                    variable.assign(member_part(value, i, index))

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "graph": keras.saving.serialize_keras_object(self.graph),
            "n_members": self.n_members,
            "input_mode": self.input_mode,
            "layer_index": self.layer_index,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["graph"] = keras.saving.deserialize_keras_object(
            config["graph"], custom_objects=custom_objects
        )
        return cls(**config)


def build_fused_model(members: Sequence[keras.Model], input_mode: str = "replicate") -> FusedModel:
    """Fuse same-architecture members into one `FusedModel` with stacked weights.

    Each member's current weights are copied into its slice; the members themselves are
    left untouched. Raises `ValueError` carrying the `fusion_report` when the members
    cannot be fused.

    Args:
        members: The N member models (Sequential or Functional, same architecture).
            Defaults to none (required).
        input_mode: `"replicate"`: inputs `(B, ...)` shared by all members;
            `"stacked"`: inputs `(N, b, ...)`, one slice per member. Defaults to
            `"replicate"`.

    Returns:
        The `FusedModel`.

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion import build_fused_model

    def build():
        inputs = keras.Input((8,))
        x = keras.layers.Dense(16, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(1)(x))

    fused = build_fused_model([build() for _ in range(4)], input_mode="stacked")
    print(fused(keras.ops.ones((4, 2, 8))).shape)  # (4, 2, 1)
    ```
    """
    if input_mode not in _INPUT_MODES:
        raise ValueError(
            f"Invalid value for argument `input_mode`: got {input_mode!r}. Expected one of "
            f"{_INPUT_MODES}."
        )
    members = list(members)
    report, plan = inspect_members(members)
    if not report.fusable:
        raise ValueError(f"These members cannot be fused.\n{report}")
    return fuse_planned(members, plan, input_mode)


def fuse_planned(
    members: Sequence[keras.Model], plan: Any, input_mode: str = "replicate"
) -> FusedModel:
    """`build_fused_model` for members already inspected: `plan` is their `FusionPlan`."""
    with members_loaded_after():
        graph, layer_index = converter.build_graph(plan, len(members), input_mode)
    fused = FusedModel(
        graph,
        n_members=len(members),
        input_mode=input_mode,
        layer_index=layer_index,
        name=graph.name,
    )
    fused.load_from_members(members)
    logger.debug("Fused %d members into %s.", len(members), fused.name)
    return fused


def _member_config(fused_layer: Any) -> dict:
    """The member layer config a fused layer was made from (member 0's values)."""
    own = ("per_member", "input_layouts", "slot_values")
    return {k: v for k, v in fused_layer.member_config.items() if k not in own}


def _axes(index, shape):
    """`np.ix_` of a per-axis index (`None` entries mean the whole axis)."""
    return np.ix_(*[np.arange(size) if a is None else a for a, size in zip(index, shape)])


def member_part(value, i, index):
    """Member `i`'s own part of a stacked value (`index` from `member_variable_map`)."""
    if index is None:
        return value[i]
    return value[i][_axes(index, value.shape[1:])]


def set_member_part(value, i, index, part):
    """Writes member `i`'s own part into a stacked NumPy value, in place."""
    if index is None:
        value[i] = part
    else:
        value[i][_axes(index, value.shape[1:])] = part


def _check_part(variable, fused_variable, index, i):
    shape = tuple(fused_variable.shape[1:])
    if index is not None:
        shape = tuple(
            size if a is None else len(a) for a, size in zip(index, fused_variable.shape[1:])
        )
    if tuple(variable.shape) != shape:
        raise ValueError(
            f"Member {i}'s variable `{variable.path}` of shape {tuple(variable.shape)} does "
            f"not fit the fused variable `{fused_variable.path}` of shape "
            f"{tuple(fused_variable.shape)}. Pass members with the architecture the model "
            "was built from."
        )
