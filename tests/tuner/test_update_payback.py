"""When the slots executor compiles a program's optimizer update with XLA (`_update_payback`).

The decision rests on the steps a program is expected to run, counted from the search's
arrays, batch size, validation split and remaining trials; the measured searches of
docs/benchmarks.md ("A fused optimizer update") fall on the sides they were measured on.
"""

import numpy as np
import pytest

from keras_gpushare.tuner._update_payback import expected_steps, fuse_update_pays

# Stacked parameters of the getting-started programs (slots at 3 layers of 256 units).
SLOT_PARAMETERS = 784 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 10 + 10


def test_expected_steps_count_the_training_arrays_batches_per_program_epoch():
    x = np.zeros((4096, 28, 28), "float32")
    kwargs = {"validation_split": 0.2, "epochs": 5}
    # 32 trials x 5 epochs through 16 slots: 10 program epochs of ceil(3276 / 64) batches.
    assert expected_steps(160, 16, 64, (x,), kwargs) == 10 * 52
    assert expected_steps(160, 16, None, (), {"x": x}) == 10 * 128
    assert expected_steps(7, 4, 100, (x,), {"validation_data": (x, x)}) == 2 * 41


@pytest.mark.parametrize(
    "fit_args", [(), ([[1.0], [2.0]],), (iter([]),)], ids=["no x", "a list", "an iterator"]
)
def test_expected_steps_are_unknown_without_arrays(fit_args):
    assert expected_steps(10, 2, 32, fit_args, {}) is None


def test_expected_steps_are_unknown_without_the_remaining_trials():
    assert expected_steps(None, 16, 64, (np.zeros((64, 3)),), {}) is None


def test_the_measured_searches_fall_on_their_sides():
    # 16 trials x 3 epochs through 8 slots on 2,048 samples lost 0.5 s with the fused update.
    short = expected_steps(16 * 3, 8, 64, (np.zeros((2048, 1)),), {"validation_split": 0.2})
    assert not fuse_update_pays(short, 8 * SLOT_PARAMETERS)
    # 32 trials x 5 epochs through 16 slots on 4,096 samples gained 3.5 s.
    long = expected_steps(32 * 5, 16, 64, (np.zeros((4096, 1)),), {"validation_split": 0.2})
    assert fuse_update_pays(long, 16 * SLOT_PARAMETERS)
    assert not fuse_update_pays(None, 16 * SLOT_PARAMETERS)
