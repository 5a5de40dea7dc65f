"""A pack reads each member once, from `ModelPack(members)` through `compile`.

The converter's reading of a member (`converter.member_graph`: its layer graph, in order) is
counted by member, as are the sets of members the planner inspects (`inspect_graphs`): the
planner reads every member once into the plan (`EnginePlan.readings`), tries its sets of
members from those readings, each set once, and `compile`, which re-plans by optimizer,
reads no member again. Backend-neutral (the Makefile reruns tests/pack/fusion on JAX); the
re-plan that moves a member to the graph engine needs TensorFlow's.
"""

import collections
import warnings

import keras
import pytest
from keras import layers

import keras_gpushare as kg
from keras_gpushare.pack import planner
from keras_gpushare.pack.fusion import converter


def mlp(width, norm_center=None):
    stack = [keras.Input((4,)), layers.Dense(width, activation="relu")]
    if norm_center is not None:
        stack.append(layers.LayerNormalization(center=norm_center))
    return keras.Sequential([*stack, layers.Dense(1)])


@pytest.fixture
def readings(monkeypatch):
    """Counts each model's readings by the converter, and the sets the planner inspects."""
    read: collections.Counter = collections.Counter()
    inspected: list[tuple[int, ...]] = []
    member_graph, inspect_graphs = converter.member_graph, planner.inspect_graphs

    def counted_member_graph(model):
        read[id(model)] += 1
        return member_graph(model)

    def counted_inspect_graphs(graphs, *args):
        inspected.append(tuple(id(graph) for graph, _ in graphs))
        return inspect_graphs(graphs, *args)

    monkeypatch.setattr(converter, "member_graph", counted_member_graph)
    monkeypatch.setattr(planner, "inspect_graphs", counted_inspect_graphs)
    return read, inspected


def packed_and_compiled(members, optimizer):
    pack = kg.ModelPack(members)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The warning of a member moved to the graph engine.
        pack.compile(optimizer=optimizer, loss="mse")
    pack.refresh_members()
    return pack


@pytest.mark.parametrize(
    "members, groups",
    [
        # One group of four widths (the cost model decides how to split it).
        ([mlp(w) for w in (4, 8, 16, 32)], [(0, 1, 2, 3)]),
        # One skeleton that fuses only in two sets: the planner tries sets of members.
        ([mlp(8, True), mlp(8, True), mlp(8, False), mlp(8, False)], [(0, 1), (2, 3)]),
    ],
    ids=["widths", "split"],
)
def test_each_member_is_read_once_and_each_set_inspected_once(readings, members, groups):
    read, inspected = readings
    pack = packed_and_compiled(members, "adam")
    assert pack.engine_plan.groups == groups
    assert [read[id(m)] for m in members] == [1] * len(members)
    assert len(inspected) == len(set(inspected))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the graph engine")
def test_compile_replans_by_optimizer_without_reading_the_members_again(readings):
    read, inspected = readings
    members = [mlp(w) for w in (4, 8, 16, 32)]
    optimizers = [keras.optimizers.Adam(use_ema=i == 1) for i in range(4)]
    pack = packed_and_compiled(members, optimizers)
    assert (pack.engine_plan.groups, pack.engine_plan.graph) == ([(0, 2, 3)], (1,))
    assert [read[id(m)] for m in members] == [1, 1, 1, 1]
    # The group as planned, then the group without member 1 (from the readings).
    assert len(inspected) == len(set(inspected)) == 2
