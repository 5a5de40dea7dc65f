"""`FusedModel`: N same-architecture members as one model with stacked weights."""

import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gpushare.pack.fusion import converter, registry
from keras_gpushare.pack.fusion.base import FusedLayer, members_loaded_after
from keras_gpushare.pack.fusion.layers_core import FusedSkip, skip_name
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
        self._slots = _SlotBook()

    def call(self, inputs, training=None):
        return self.graph(inputs, training=training)

    @property
    def xla_pays_on_cpu(self) -> bool:
        """Whether XLA pays for this model on a CPU: no fused layer says otherwise."""
        return all(getattr(layer, "xla_pays_on_cpu", True) for layer in self.graph.layers)

    def member_variable_map(
        self, members: Sequence[keras.Model], graphs: Sequence[Any] | None = None
    ) -> list:
        """Pair every fused variable with the member variables it stacks.

        Args:
            members: The N member models, structured like those the model was built
                from. Defaults to none (required).
            graphs: the members' `MemberGraph`s where they were read already (a
                `FusionPlan`'s); `None` reads them. Defaults to `None`.

        Returns:
            A list of `(fused_variable, parts)`, trainable and non-trainable variables
            alike, in the order of `self.weights`. `parts[i]` is `(variable, index)`:
            member `i`'s variable (`None` when the member has none: it leaves the layer
            out, or has no bias) and where it lies in slice `i` of the fused variable
            (`index`, a tuple of per-axis positions for `member_part`; `None`: the whole
            slice).
        """
        members = list(members)
        book = self._slots
        if book.map_loads == book.loads and _same_objects(book.map_members, members):
            return book.map_pairs
        if len(members) != self.n_members:
            raise ValueError(
                f"Invalid value for argument `members`: got {len(members)} models for a "
                f"fused model of {self.n_members} members. Pass the {self.n_members} "
                "members it was built from."
            )
        if graphs is None:
            graphs = [_mapped_graph(i, member) for i, member in enumerate(members)]
        pairs = []
        for layer in self.graph.layers:
            positions = self.layer_index.get(layer.name)
            if positions is None:
                continue
            if isinstance(positions, int):
                positions = [positions] * self.n_members
            positions = [
                book.positions[i].get(layer.name) if i in book.positions else p
                for i, p in enumerate(positions)
            ]
            member_layers = [None if p is None else g.layers[p] for g, p in zip(graphs, positions)]
            for k, fused_variable in enumerate(layer.weights):
                parts = []
                for i, member_layer in enumerate(member_layers):
                    variable, index = None, None
                    if member_layer is not None:
                        position, index = layer.member_weight_index(k, i)
                        variable = None if position is None else member_layer.weights[position]
                    if variable is not None:
                        _check_part(variable, fused_variable, index, i)
                    parts.append((variable, index))
                pairs.append((fused_variable, tuple(parts)))
        book.map_members, book.map_loads, book.map_pairs = members, book.loads, pairs
        return pairs

    def load_from_members(
        self, members: Sequence[keras.Model], graphs: Sequence[Any] | None = None
    ) -> None:
        """Copy every member's weights into its slice of the stacked weights.

        Padding (what no member owns) is set to zero.

        Args:
            members: The N member models. Defaults to none (required).
            graphs: the members' `MemberGraph`s where they were read already, as for
                `member_variable_map`. Defaults to `None`.
        """
        for fused_variable, parts in self.member_variable_map(members, graphs):
            if all(variable is None for variable, _ in parts):
                continue  # The layer's own (the settings a slot holds), not the members'.
            value = np.zeros(fused_variable.shape, dtype=fused_variable.dtype)
            for i, (variable, index) in enumerate(parts):
                if variable is not None:
                    set_member_part(value, i, index, ops.convert_to_numpy(variable))
            fused_variable.assign(value)

    @property
    def holds_slots(self) -> bool:
        """Whether some fused layer holds its members' settings as data (`settings.HELD`)."""
        return any(
            isinstance(layer, FusedLayer) and layer.settings.held for layer in self.graph.layers
        )

    def slot_layers(self, model: keras.Model) -> tuple[list, str | None]:
        """How `model` takes a slot by values: its layer for each fused layer, or why not.

        It can when every fused layer it uses holds its members' settings as data
        (`FusedLayer.settings`) and `model`'s layers are this model's calls in order,
        each within what its fused layer holds, leaving out only calls a slot may skip
        (those followed by a `FusedSkip`: a model of another depth, or without a
        `Dropout`).

        Args:
            model: the model to load.

        Returns:
            `(plan, None)`, with a `(fused layer, its skip or None, model's layer or None,
            its position in model's graph)` for each fused layer, or `([], why not)`.
        """
        graph, why = converter.member_graph(model)
        if why:
            return [], why
        calls = self._slot_calls()
        layers = [node.operation for node in graph.nodes]
        chosen = _align(calls, layers)
        if chosen is None:
            if len(layers) == len(calls):
                for (fused_layer, _), layer in zip(calls, layers):
                    problem = _slot_problem(fused_layer, layer)
                    if problem:
                        return [], problem
            kinds = ", ".join(type(layer).__name__ for layer in layers)
            expected = ", ".join(
                type(layer).__name__.removeprefix("Fused") + ("?" if skip is not None else "")
                for layer, skip in calls
            )
            return [], f"its layers are {kinds}; the slot's are {expected} ('?': may be left out)"
        plan = [
            (fused_layer, skip, layer, None if layer is None else graph.layers.index(layer))
            for (fused_layer, skip), layer in zip(calls, chosen)
        ]
        return plan, None

    def _slot_calls(self) -> list:
        """The fused layers that stand for member layers, in call order, each with the
        `FusedSkip` that lets a slot leave it out (`None` where none does)."""
        skips = {layer.name: layer for layer in self.graph.layers if isinstance(layer, FusedSkip)}
        return [
            (layer, skips.get(skip_name(layer.name)))
            for layer in self.graph.layers
            if layer.name in self.layer_index
        ]

    def load_member(self, j: int, plan: list) -> None:
        """Writes each model layer of `plan` (from `slot_layers`) into slot `j`."""
        self._slots.loads += 1
        positions = {}
        for fused_layer, skip, layer, position in plan:
            positions[fused_layer.name] = position
            if skip is not None:
                skip.set_present(j, layer is not None)
            if not fused_layer.settings.held:
                continue
            if layer is None:
                fused_layer.clear_member(j)
            else:
                fused_layer.load_member(j, layer)
        self._slots.positions[j] = positions

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


class _SlotBook:
    """What loading models into slots changed, held out of Keras's attribute tracking:
    each loaded slot's layer positions (`positions[j]`: fused layer name to the position
    of its layer in the loaded model, `None` where it skips), a count of loads, and the
    last `member_variable_map` with the members and count it was made for."""

    def __init__(self):
        self.positions: dict[int, dict[str, int | None]] = {}
        self.loads = 0
        self.map_members, self.map_loads, self.map_pairs = None, None, None


def _slot_problem(fused_layer: Any, layer: Any) -> str | None:
    """Why `layer` cannot take a slot of `fused_layer` by values, or `None`."""
    if fused_layer.weights and not fused_layer.settings.held:
        return f"the slot's layer `{fused_layer.name}` holds its settings as constants"
    if any(
        value is not None
        for key in fused_layer.regularizer_keys
        for value in fused_layer.per_member(key)
    ):
        return f"the slot's layer `{fused_layer.name}` has weight regularizers"
    fused_class = registry.fused_form(type(layer))
    if fused_class is not type(fused_layer):
        return f"its layer `{layer.name}` is a `{type(layer).__name__}`"
    keys = fused_layer.slot_keys if fused_layer.settings.held else ()
    config = converter.comparable_config(layer.get_config(), keys)
    expected = converter.comparable_config(_member_config(fused_layer), keys)
    if config != expected:
        key = next(k for k in sorted({*config, *expected}) if config.get(k) != expected.get(k))
        return (
            f"its layer `{layer.name}` sets `{key}={config.get(key)!r}` where the slot's "
            f"has {expected.get(key)!r}"
        )
    return fused_layer.slot_problem(layer) if fused_layer.settings.held else None


def _align(calls: list, layers: list) -> list | None:
    """`layers` spread over the fused `calls` in order (`None` where a call is skipped,
    which only calls with a skip may be), each taking its call by values; `None` if no
    way does."""
    n, m = len(calls), len(layers)
    # fits[a][b]: layer b can take call a.
    fits = [[_slot_problem(calls[a][0], layers[b]) is None for b in range(m)] for a in range(n)]
    # possible[a][b]: calls[a:] can take layers[b:].
    possible = [[False] * (m + 1) for _ in range(n + 1)]
    possible[n][m] = True
    for a in range(n - 1, -1, -1):
        for b in range(m, -1, -1):
            take = b < m and fits[a][b] and possible[a + 1][b + 1]
            skip = calls[a][1] is not None and possible[a + 1][b]
            possible[a][b] = take or skip
    if not possible[0][0]:
        return None
    chosen, b = [], 0
    for a in range(n):
        if b < m and fits[a][b] and possible[a + 1][b + 1]:
            chosen.append(layers[b])
            b += 1
        else:
            chosen.append(None)
    return chosen


def _same_objects(a, b):
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


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
    fused.load_from_members(members, plan.graphs)
    logger.debug("Fused %d members into %s.", len(members), fused.name)
    return fused


def _mapped_graph(i: int, member: keras.Model) -> Any:
    """Member `i`'s `MemberGraph`, or an error saying why it cannot be mapped."""
    graph, why = converter.member_graph(member)
    if why:
        raise ValueError(f"Member {i} cannot be mapped onto the fused model: {why}.")
    return graph


def _member_config(fused_layer: Any) -> dict:
    """The member layer config a fused layer was made from (member 0's values)."""
    own = ("per_member", "input_layouts", "settings", "slot_capacity")
    config = {k: v for k, v in fused_layer.member_config.items() if k not in own}
    if "class_name" in config and isinstance(config.get("config"), dict):
        # Wrappers of any per-sample layer keep it serialized (class and config).
        return config["config"]
    return config


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
