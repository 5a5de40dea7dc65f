"""The step's stacked logs and the pack's `m{i}_` logs made from them.

A fused group reports its running means (the loss, `accuracy`) undivided, as totals and
counts; the division, and NaN for a member that ran no step, happen where the logs are
read. Runs on TensorFlow, JAX and torch.
"""

import keras
import numpy as np
from keras import ops

import keras_gpushare as kg
from keras_gpushare.pack._loop import _logs
from keras_gpushare.pack.engines.base import GroupFigures, StackedRatio


def _tensor(values):
    return ops.convert_to_tensor(np.asarray(values, "float32"))


def test_undivided_means_become_each_members_figures_and_the_mean_loss():
    totals, counts = _tensor([3.0, 5.0, 0.0]), _tensor([2.0, 4.0, 0.0])
    hits = StackedRatio(_tensor([1.0, 3.0, 0.0]), counts)
    figures = GroupFigures(StackedRatio(totals, counts), None, {"accuracy": hits}, [{}, {}, {}])
    step = _logs.step_logs([((0, 2, 1), figures)])
    assert not any(key.startswith("_kg_stacked") for key in step)

    logs = _logs.expanded(step, [(0, 2, 1)], 3)

    # Member 2 sits in the group's second row: 5/4 and 3/4. Member 1 ran no step.
    assert logs["m0_loss"] == np.float32(1.5) and logs["m2_loss"] == np.float32(1.25)
    assert logs["m0_accuracy"] == np.float32(0.5) and logs["m2_accuracy"] == np.float32(0.75)
    assert np.isnan(logs["m1_loss"]) and np.isnan(logs["m1_accuracy"])
    assert logs["loss"] == np.float32((1.5 + 1.25) / 2)
    assert list(logs)[:4] == ["loss", "m0_loss", "m0_accuracy", "m1_loss"]


def test_a_fused_packs_step_logs_carry_its_running_means_undivided():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    members = []
    for seed in range(3):
        keras.utils.set_random_seed(seed)
        members.append(
            keras.Sequential(
                [keras.Input((4,)), keras.layers.Dense(3 + seed), keras.layers.Dense(1)]
            )
        )
    pack = kg.ModelPack(members)
    pack.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    history = pack.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert pack.engine == "fused"

    step = pack._logs()

    assert {key.split("/")[0] for key in step} == {"_kg_total", "_kg_count"}
    engine = pack._engines[0]
    states = {"loss": engine.loss_state, "mae": engine.metric_states["mae"]}
    for name, state in states.items():
        means = ops.convert_to_numpy(state.result())
        for row, i in enumerate(engine.member_ids):
            assert history.history[f"m{i}_{name}"][-1] == means[row]
