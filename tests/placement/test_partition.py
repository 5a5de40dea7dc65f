"""Balance policies cut the layers into contiguous stages."""

import pytest
from placement_models import mlp

import keras_gpushare as kg
from keras_gpushare.placement.partition import partition


def test_partition_minimizes_largest_stage():
    assert partition([1, 1, 1, 1], 2) == [2, 2]
    assert partition([8, 1, 1, 1, 1], 2) == [1, 4]
    assert partition([1, 2, 3, 4, 5, 6], 3) == [3, 2, 1]
    assert partition([0, 0, 0, 0], 4) == [1, 1, 1, 1]


@pytest.mark.parametrize("balance", ["params", "flops", "memory", "time"])
def test_policies_give_contiguous_nonempty_stages(balance):
    placed = kg.split_model(mlp(), ["/CPU:1", "/CPU:2"], balance=balance, batch_size=8)
    names = placed.plan.layer_names
    assert [n for stage in names for n in stage] == ["d1", "d2", "d3", "out"]
    assert all(names)


def test_layer_name_split_points():
    placed = kg.split_model(mlp(), ["/CPU:1", "/CPU:2", "/CPU:3"], balance=["d2", "out"])
    assert placed.plan.layer_names == [["d1"], ["d2", "d3"], ["out"]]
