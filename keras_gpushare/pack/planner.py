"""Which engine trains which members: fused groups, and the graph engine for the rest.

`fuse="auto"` puts members that can be computed together into fused groups (one stacked
model each) and leaves only what fuses with nothing to the graph engine (TensorFlow), all
trained in one step. The plan and why each member landed where it did is the pack's
`fusion_report`. The planner also builds the engines a plan names (`build_engines`), and
re-plans at `compile` when a fused member's optimizer cannot be vectorized
(`optimizer_moves`, `move_to_graph`).

Each member is read once, when the pack is made (`MemberReading`: its graph, whether it
has an `Embedding`, its optimizer's class); every set of members the planner tries, then and
at `compile`, is inspected from those readings (`report.inspect_graphs`), each set once.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack.engines.base import Engine, EngineOptions
from keras_gpushare.pack.engines.fused import FusedEngine
from keras_gpushare.pack.fusion import converter, cost, template
from keras_gpushare.pack.fusion._member_settings import member_settings
from keras_gpushare.pack.fusion.report import inspect_graphs
from keras_gpushare.pack.fusion.settings import CONSTANTS, Settings


@dataclasses.dataclass(frozen=True)
class MemberReading:
    """What the planner reads of one member, once, when the pack is made.

    Attributes:
        graph: the member's `MemberGraph`, or `None` when it has none to fuse.
        why: why it has no graph (`None` when it has one).
        embedding: whether it holds an `Embedding` layer (nested models included), whose
            sparse gradient on TensorFlow some optimizers train differently fused.
        optimizer_family: the class name of the optimizer it was compiled with ("" when
            none), by which a group orders its members.
    """

    graph: Any
    why: str | None
    embedding: bool
    optimizer_family: str

    @classmethod
    def of(cls, member: keras.Model) -> MemberReading:
        """Reads `member` (its graph through `converter.member_graph`)."""
        graph, why = converter.member_graph(member)
        embedding = any(isinstance(layer, keras.layers.Embedding) for layer in _all_layers(member))
        return cls(graph, why, embedding, _optimizer_family(member))


@dataclasses.dataclass
class EnginePlan:
    """The pack's engines: fused groups of member indices, and the graph engine's members.

    Attributes:
        groups: each fused group's members, in their order in the stacked weights.
        graph: the members the graph engine trains.
        reports: one `FusionReport` per fused group.
        reasons: why each graph member is not fused (a sentence per member index).
        waste: for each fused group, the share of its estimated FLOPs that is padding.
        fusion_plans: for each fused group, the `FusionPlan` its members were inspected
            with (its engine builds the fused model from it).
        readings: the `MemberReading` of each member the planner may fuse, by member
            index: what `compile` re-plans from, without reading the members again.
        settings: how the fused layers and the optimizer hold the members' settings
            (`fusion.settings`), the same for every group.
    """

    groups: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    graph: tuple[int, ...] = ()
    reports: list[Any] = dataclasses.field(default_factory=list)
    reasons: dict[int, str] = dataclasses.field(default_factory=dict)
    waste: list[float] = dataclasses.field(default_factory=list)
    fusion_plans: list[Any] = dataclasses.field(default_factory=list)
    settings: Settings = CONSTANTS
    readings: dict[int, MemberReading] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )

    def inspect(self, ids: Sequence[int]) -> tuple[Any, Any]:
        """The `FusionReport` and `FusionPlan` (`None` unless they fuse) of the members
        `ids`, in that order, from their readings."""
        read = [(self.readings[i].graph, self.readings[i].why) for i in ids]
        return inspect_graphs(read, self.settings)

    def __str__(self) -> str:
        n = sum(len(g) for g in self.groups) + len(self.graph)
        parts = []
        if self.groups:
            parts.append(f"{len(self.groups)} fused group{'s' if len(self.groups) > 1 else ''}")
        if self.graph:
            parts.append(f"{len(self.graph)} on the graph engine")
        lines = [f"ModelPack plan for {n} members: {', '.join(parts)}."]
        wastes = self.waste + [0.0] * (len(self.groups) - len(self.waste))
        for k, (group, report, waste) in enumerate(zip(self.groups, self.reports, wastes)):
            members = ", ".join(str(i) for i in group)
            padding = f", padding {waste:.0%} of its FLOPs" if waste else ""
            lines.append(f"group {k} (fused): members {members}{padding}")
            lines.extend("  " + line for line in str(report).splitlines())
        for i in self.graph:
            lines.append(f"member {i} on the graph engine: {self.reasons.get(i, 'fuse=False')}")
        return "\n".join(lines)


def plan_engines(
    members: Sequence[keras.Model],
    fuse: str | bool,
    data: str,
    groups: Sequence[Sequence[int]] | None = None,
    fused_shard: bool = False,
    settings: Settings = CONSTANTS,
) -> EnginePlan:
    """Plans the engines for `members`.

    Args:
        members: the pack's members.
        fuse: `"auto"`, `True` (every member must fuse) or `False` (graph engine only).
        data: the pack's data mode; `"shard"` trains on the graph engine where there is
            one (TensorFlow) unless `fused_shard`, and fuses elsewhere.
        groups: fused groups given explicitly (a pack read back from a file keeps its
            saved plan); the other members go to the graph engine.
        fused_shard: fuse `data="shard"` members on TensorFlow too (the tuner's programs,
            whose batches always split evenly).
        settings: how the fused layers and the optimizer hold the members' settings
            (`fusion.settings`); the plan keeps it, for every group it fuses.

    Raises:
        ValueError: with `fuse=True` when some member cannot fuse, or when members need the
            graph engine on a backend other than TensorFlow.
    """
    n = len(members)
    shared = shared_weights(members)
    if shared and not BACKEND.graph_engine:
        raise ValueError(_shared_error(shared))
    plan = EnginePlan(settings=settings)
    if groups is not None:
        kept = [tuple(i for i in g if i not in shared) for g in groups]
        plan.readings = {i: MemberReading.of(members[i]) for g in kept for i in g}
        _set_groups(plan, [g for g in kept if g])
        grouped = {i for g in plan.groups for i in g}
        plan.graph = tuple(i for i in range(n) if i not in grouped)
        plan.reasons.update(shared)
    elif fuse is False:
        plan.graph = tuple(range(n))
        plan.reasons = {i: "fuse=False." for i in range(n)}
    elif not all(m.built for m in members):
        plan.graph = tuple(range(n))
        reason = "some members are not built yet; give them a keras.Input."
        plan.reasons = {i: reason for i in range(n)}
    elif data != "replicate" and BACKEND.graph_engine and not fused_shard:
        plan.graph = tuple(range(n))
        plan.reasons = {i: f'data="{data}" runs on the graph engine.' for i in range(n)}
    else:
        plan.readings = {i: MemberReading.of(m) for i, m in enumerate(members) if i not in shared}
        _group(plan, n, alone_on_graph=BACKEND.graph_engine and fuse == "auto", shared=shared)
    if fuse is True and plan.graph:
        reasons = "; ".join(f"member {i}: {plan.reasons[i]}" for i in plan.graph)
        raise ValueError(f"Invalid value for argument `fuse`: True, but {reasons}\n{plan}")
    if plan.graph and not BACKEND.graph_engine:
        first = plan.graph[0]
        others = f" (and members {', '.join(map(str, plan.graph[1:]))})" if plan.graph[1:] else ""
        raise ValueError(
            f"Member {first}{others} cannot fuse: {plan.reasons[first]} On the "
            f"{BACKEND.name!r} backend every member must fuse (the graph engine, which trains "
            f"members that do not, needs the TensorFlow backend).\n{plan}"
        )
    return plan


def build_engines(
    plan: EnginePlan, members: Sequence[keras.Model], options: EngineOptions
) -> list[Engine]:
    """The engines `plan` names: one fused engine per group, then the graph engine for the
    rest, if any.

    Args:
        plan: the pack's plan.
        members: the pack's members.
        options: the pack's `EngineOptions`, handed to every engine.
    """
    engines: list[Engine] = [
        FusedEngine([members[i] for i in group], group, options, fusion_plan)
        for group, fusion_plan in zip(plan.groups, plan.fusion_plans, strict=True)
    ]
    if plan.graph:
        engines.append(_graph_engine_class()([members[i] for i in plan.graph], plan.graph, options))
    return engines


def optimizer_moves(plan: EnginePlan, optimizers: Sequence[Any]) -> dict[int, str]:
    """The fused members that the pack's vectorized optimizer cannot train as their own
    fits would, and why (a sentence per member index): decided from `plan`'s readings,
    without reading the members again.

    Args:
        plan: the pack's plan.
        optimizers: each member's optimizer, in member order.
    """
    reasons = {}
    for i in (i for group in plan.groups for i in group):
        try:
            settings = member_settings(i, optimizers[i])
        except ValueError as e:
            reasons[i] = str(e)
            continue
        reason = _sparse_difference(plan.readings[i], settings)
        if reason:
            reasons[i] = reason
    return reasons


def move_to_graph(
    plan: EnginePlan,
    members: Sequence[keras.Model],
    engines: Sequence[Engine],
    reasons: dict[int, str],
    options: EngineOptions,
) -> list[Engine]:
    """Takes the members `reasons` names out of their fused groups, onto the graph engine.

    The members first take their engines' current weights; `plan` is updated in place: a
    group that loses members is inspected again from its members' readings, the others
    keep theirs.

    Args:
        plan: the pack's plan.
        members: the pack's members.
        engines: the pack's engines now.
        reasons: why each member moves, by member index.
        options: the pack's `EngineOptions`.

    Returns:
        The engines of the new plan.
    """
    for engine in engines:
        engine.sync_members()
    groups = [tuple(i for i in g if i not in reasons) for g in plan.groups]
    _set_groups(plan, [g for g in groups if g])
    plan.graph = tuple(sorted({*plan.graph, *reasons}))
    plan.reasons.update(reasons)
    return build_engines(plan, members, options)


def _graph_engine_class() -> type[Engine]:
    """The graph engine (TensorFlow), imported only where it is used."""
    from keras_gpushare.pack.engines.graph import GraphEngine

    return GraphEngine


def _sparse_difference(reading: MemberReading, settings: Any) -> str | None:
    """Why a fused member (`reading`) would train differently from its TensorFlow fit, or
    `None`.

    On TensorFlow an `Embedding` table gets a sparse gradient (one slice per occurrence of a
    token in the batch), and Keras's optimizers apply their element-wise operations to each
    slice before adding them up: `Adam` adds the squares of a token's occurrences where the
    fused engine, like Keras on JAX and torch, squares their sum. Only optimizers whose
    update is linear in the gradient (SGD, Lion, without clipping) agree.
    """
    if not BACKEND.sparse_embedding_gradients or not reading.embedding:
        return None
    if settings.rule.linear_in_gradient and not any(settings.clip.values()):
        return None
    return (
        "on TensorFlow Keras updates an `Embedding` table from its sparse gradient, applying "
        "the optimizer's element-wise operations (the squares of `Adam`, `RMSprop`, ...) to "
        "each occurrence of a token before adding them up, where the fused engine, like "
        "Keras on JAX and torch, adds them first; the graph engine trains this member as "
        "its own fit does (on JAX and torch it fuses)."
    )


def _all_layers(model: keras.Layer) -> Iterator[keras.Layer]:
    """`model`'s layers, those of nested models included."""
    for layer in getattr(model, "layers", []):
        yield layer
        yield from _all_layers(layer)


def _set_groups(plan: EnginePlan, groups: list[tuple[int, ...]]) -> None:
    """Sets `plan`'s fused groups, with each group's report, fusion plan and padding waste:
    a group `plan` holds already keeps its own, a new one is inspected from the readings."""
    held = dict(zip(plan.groups, zip(plan.reports, plan.fusion_plans, plan.waste)))
    plan.groups, plan.reports, plan.waste, plan.fusion_plans = groups, [], [], []
    for group in groups:
        if group in held:
            report, fusion_plan, waste = held[group]
        else:
            report, fusion_plan = plan.inspect(group)
            report.member_ids = list(group)
            waste = 0.0
            if fusion_plan is not None:
                waste = cost.GroupCosts(fusion_plan).waste(range(len(group)))
        plan.reports.append(report)
        plan.fusion_plans.append(fusion_plan)
        plan.waste.append(waste)


def shared_weights(members: Sequence[keras.Model]) -> dict[int, str]:
    """The members that share a layer or a weight with another member, and what they share.

    Two members holding one layer object (a shared embedding or encoder, tied weights) do
    not train as two fits with copies of it: the fused engine would stack a copy for each
    member, so such members train on the graph engine, which updates the one object.

    Returns:
        For each member that shares, a sentence naming what it shares and with whom.
    """
    owners: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for i, member in enumerate(members):
        for layer in {id(layer): layer for layer in member.layers if layer.weights}.values():
            owners.setdefault(id(layer), []).append(i)
            names[id(layer)] = f"layer `{layer.name}`"
    in_shared_layers = {
        id(variable)
        for i, member in enumerate(members)
        for layer in member.layers
        if len(owners.get(id(layer), ())) > 1
        for variable in layer.weights
    }
    for i, member in enumerate(members):
        for variable in {id(v): v for v in member.weights}.values():
            if id(variable) not in in_shared_layers:
                owners.setdefault(id(variable), []).append(i)
                names[id(variable)] = f"weight `{variable.path}`"
    found: dict[int, list[str]] = {}
    for key, ids in owners.items():
        if len(ids) < 2:
            continue
        for i in ids:
            others = ", ".join(str(j) for j in ids if j != i)
            found.setdefault(i, []).append(f"{names[key]} with member {others}")
    return {
        i: (
            f"it shares {'; '.join(what)}: the fused engine would give each member its own "
            "copy, so members that share layers train on the graph engine (each step updates "
            "the shared weights member after member, as interleaved fits)."
        )
        for i, what in sorted(found.items())
    }


def _shared_error(shared: dict[int, str]) -> str:
    ids = ", ".join(str(i) for i in shared)
    first = next(iter(shared))
    what = shared[first].split(":")[0].removeprefix("it shares ")
    return (
        f"Invalid value for argument `members`: members {ids} share layers (member {first} "
        f"shares {what}). A ModelPack trains each member as its own fit, and on the "
        f"{BACKEND.name!r} backend every member must fuse, but the fused engine "
        "stacks a copy of each member's weights and would untie a shared layer. Give each "
        "member its own layers, or make the models that share a layer one member (one "
        "Functional model with all their outputs, trained on the sum of its losses), or use "
        "the TensorFlow backend, whose graph engine trains members that share layers."
    )


def _group(plan: EnginePlan, count: int, alone_on_graph: bool, shared: dict[int, str]) -> None:
    """Fills `plan` with fused groups of the `count` members that fuse together, and the
    rest, from the members' readings (each set of members inspected once).

    Members with the same skeleton (the same calls, sizes and depths aside) are inspected
    together; those that do not fuse as a whole are split into sets that do
    (`_fusable_sets`), so one odd member forms its own group and leaves the rest fused.
    Within a set, the cost model (`fusion.cost`) splits the members into the groups that
    take the least estimated time, merging members of equal sizes first. Members in
    `shared` (they share layers) go to the graph engine.
    """
    inspect = functools.cache(plan.inspect)
    classes: dict[Any, list[int]] = {}
    for i, reading in plan.readings.items():
        graph = reading.graph
        key = ("alone", i) if graph is None else template.skeleton(graph)
        classes.setdefault(key, []).append(i)
    graph_members = list(shared)
    plan.reasons.update(shared)
    for class_ids in classes.values():
        for ids, report, fusion_plan, why_alone in _fusable_sets(plan, inspect, class_ids):
            costs = None
            if report.fusable:
                costs = cost.GroupCosts(fusion_plan)
                exact: dict[Any, list[int]] = {}
                for position, i in enumerate(ids):
                    signature = converter.graph_signature(plan.readings[i].graph)
                    exact.setdefault(signature, []).append(position)
                parts = [
                    [ids[p] for p in part] for part in cost.partition(costs, list(exact.values()))
                ]
            else:
                parts = [ids]
            for part in parts:
                part = _ordered(part, plan.readings, ids, costs)
                part_report, part_plan = report, fusion_plan
                if part != list(ids):
                    part_report, part_plan = inspect(tuple(part))
                if not part_report.fusable:
                    reason = _first_reason(part_report, part)
                    graph_members.extend(part)
                    plan.reasons.update({i: reason for i in part})
                elif len(part) == 1 and alone_on_graph:
                    graph_members.extend(part)
                    plan.reasons[part[0]] = _alone_reason(count, why_alone)
                else:
                    part_report.member_ids = list(part)
                    plan.groups.append(tuple(part))
                    plan.reports.append(part_report)
                    plan.fusion_plans.append(part_plan)
                    positions = [ids.index(i) for i in part]
                    plan.waste.append(0.0 if costs is None else costs.waste(positions))
    plan.graph = tuple(sorted(graph_members))


def _alone_reason(count: int, why_alone: str | None) -> str:
    """Why a member that fuses with no other trains on the graph engine (`fuse="auto"`), in
    words that hold whether or not the user passed `fuse`: `count` members in the pack,
    `why_alone` why it does not fuse with the others (None: they are another kind)."""
    if count == 1:
        return "it is the pack's only member, and a pack of one trains on the graph engine."
    alone = "it fuses with no other member, and a member alone trains on the graph engine"
    return alone + (f"; with the others: {why_alone}" if why_alone else ".")


def _fusable_sets(plan: EnginePlan, inspect: Callable, ids: list[int]) -> list[tuple]:
    """`ids` split into sets of members that fuse together, as few as it can find, from
    `plan`'s readings; `inspect` is `plan.inspect`, remembering each set's answer.

    Returns `(set, report, fusion plan, why alone)` for each set: the members' report and
    plan, and for a set of one in a class of several, why it does not fuse with the largest
    other set (`None` otherwise). A member that does not fuse even alone is a set of one with an
    unfusable report.

    Members with the same calls and connections, sizes and per-member values aside
    (`template.padded_signature`), usually fuse; such a class is tried as a whole. Then
    each class joins the first set whose first member it fuses with, when the set and the
    class fuse as a whole; a class that does not fuse within itself is split member by
    member the same way. Each join is checked on the whole set, so the sets always fuse.
    Members are inspected with the plan's settings (see `plan_engines`).
    """
    report, fusion_plan = inspect(tuple(ids))
    if report.fusable or len(ids) == 1:
        return [(list(ids), report, fusion_plan, None)]
    classes: dict[Any, list[int]] = {}
    for i in ids:
        classes.setdefault(template.padded_signature(plan.readings[i].graph), []).append(i)
    units: list[list[int]] = []
    for class_ids in classes.values():
        if len(class_ids) == 1 or inspect(tuple(class_ids))[0].fusable:
            units.append(class_ids)
        else:
            units.extend([i] for i in class_ids)
    sets: list[list[int]] = []
    for unit in units:
        for joined in sets:
            if inspect((joined[0], unit[0]))[0].fusable and inspect((*joined, *unit))[0].fusable:
                joined.extend(unit)
                break
        else:
            sets.append(list(unit))
    result = []
    for found in sets:
        found.sort()
        found_report, found_plan = inspect(tuple(found))
        why_alone = None
        if len(found) == 1 and len(sets) > 1 and found_report.fusable:
            largest = max((other for other in sets if other is not found), key=len)
            pair = [largest[0], found[0]]
            why_alone = _first_reason(inspect(tuple(pair))[0], pair)
        result.append((found, found_report, found_plan, why_alone))
    return result


def _ordered(
    part: list[int], readings: dict[int, MemberReading], ids: list[int], costs: Any
) -> list[int]:
    """`part` in the order its group stacks it.

    Members of one optimizer family sit side by side: the vectorized optimizer updates each
    stretch of a family as one block. Within a family, members are ordered by the weighted
    layers they have that the group computes only for them (`GroupCosts.sliced_calls`), in
    turn up and down from one family to the next. Members of nested depths (a search over
    `num_layers`) then have each such layer in one run of the group, even across two
    families, so it takes one slice of the stacked kernel, whose gradient is one pass over
    it rather than one per run. Otherwise (Python's sort is stable) members keep their
    order in the pack, so the step needs no gather of their per-member state.
    """
    families = sorted({readings[i].optimizer_family for i in part})
    sliced = [] if costs is None else costs.sliced_calls([ids.index(i) for i in part])

    def key(i: int) -> tuple:
        family = families.index(readings[i].optimizer_family)
        has = () if costs is None else costs.layers_of(ids.index(i), sliced)
        return (family, has if family % 2 == 0 else tuple(-x for x in has))

    return sorted(part, key=key)


def _optimizer_family(member: keras.Model) -> str:
    """The class of the optimizer `member` was compiled with ("" when none)."""
    optimizer = getattr(member, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return "" if optimizer is None else type(optimizer).__name__


def _first_reason(report: Any, ids: Sequence[int]) -> str:
    """The first reason a group's `FusionReport` gives, with the pack's member numbers."""
    reason = "not fusable."
    for problem in report.problems:
        reason = f"{problem}."
        break
    else:
        for verdict in report.layers:
            if verdict.reason:
                reason = f"layer `{verdict.name}` ({verdict.type}): {verdict.reason}."
                break
    reason = re.sub(r"member (\d+)", lambda m: f"member {ids[int(m.group(1))]}", reason)
    if len(ids) == 1:
        reason = reason.removeprefix(f"member {ids[0]}: ")
    return reason
