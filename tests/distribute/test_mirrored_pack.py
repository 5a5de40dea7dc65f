"""A ModelPack under `tf.distribute.MirroredStrategy` over two logical CPUs.

Each replica trains the whole pack on half of every batch; the members must end exactly
where the same pack ends without a strategy on the same global batches.
"""

import functools
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from hang_guard import HANG_GUARD_S

import keras_gpushare as kg

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="tf.distribute needs TensorFlow"
)

N = 3
RATES = [0.01, 0.003, 0.03]


def mlp(width: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


@functools.cache
def _strategy() -> tf.distribute.Strategy:
    # One strategy per process: a second one reuses the first one's collective keys, and
    # TensorFlow then mixes up their all-reduces.
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def _data(rows: int = 96) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 10)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def _members(widths: list[int]) -> list[keras.Model]:
    return [mlp(w, seed=i) for i, w in enumerate(widths)]


def _pack(widths: list[int], engine: str, **kwargs) -> kg.ModelPack:
    pack = kg.ModelPack(_members(widths), fuse=engine == "fused", **kwargs)
    pack.compile(
        optimizer=[keras.optimizers.Adam(r) for r in RATES],
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    return pack


def _train(widths, engine, strategy=None, y=None, batch_size=16, **kwargs):
    x, y_default = _data()
    y = y_default if y is None else y
    if strategy is None:
        pack = _pack(widths, engine, **kwargs)
    else:
        with strategy.scope():
            pack = _pack(widths, engine, **kwargs)
    history = pack.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return pack, history.history


def _steps(member: keras.Model) -> int:
    return int(keras.ops.convert_to_numpy(member.optimizer.iterations))


def _assert_same_members(pack, reference):
    assert pack.status == reference.status
    for i, (got, want) in enumerate(zip(pack.members, reference.members)):
        for a, b in zip(got.get_weights(), want.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"member {i}")
        assert _steps(got) == _steps(want)


@pytest.mark.parametrize(
    ("engine", "widths", "data"),
    [
        ("fused", [8, 8, 8], "replicate"),
        ("graph", [4, 8, 12], "replicate"),
        ("graph", [4, 8, 12], "shard"),
    ],
)
def test_members_match_training_without_a_strategy(engine, widths, data):
    # With data="shard", member i trains on rows i::N of each replica's share of the batch:
    # the global batch's rows i::N when each replica's share (12) is a multiple of N.
    batch_size = 24 if data == "shard" else 16
    reference, want = _train(widths, engine, data=data, batch_size=batch_size)
    pack, got = _train(widths, engine, _strategy(), data=data, batch_size=batch_size)
    assert pack.engine == reference.engine == engine
    _assert_same_members(pack, reference)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("engine", ["fused", "graph"])
def test_a_member_non_finite_on_one_replica_is_frozen_on_all(engine):
    _, y = _data()
    labels = [y.copy() for _ in range(N)]
    # Batch 3 (rows 32-47): row 44 lies in the second replica's half only.
    labels[1][44] = np.nan
    reference, _ = _train([8, 8, 8], engine, y=labels)
    pack, history = _train([8, 8, 8], engine, _strategy(), y=labels)
    assert pack.status == ["active", "frozen:nan", "active"]
    _assert_same_members(pack, reference)
    assert _steps(pack.members[1]) == 2
    assert np.isnan(history["m1_loss"][1]) and np.isfinite(history["m0_loss"][1])


@pytest.mark.parametrize("engine", ["fused", "graph"])
def test_evaluate_predict_and_save_reload_under_the_strategy(engine, tmp_path):
    x, y = _data()
    strategy = _strategy()
    pack, _ = _train([8, 8, 8], engine, strategy)
    reference, _ = _train([8, 8, 8], engine)
    got = pack.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    want = reference.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(
        pack.predict(x, stack=True, verbose=0),
        reference.predict(x, stack=True, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    path = tmp_path / "pack.keras"
    pack.save(path)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert loaded.engine == engine
    _assert_same_members(loaded, pack)
    loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert [_steps(m) for m in loaded.members] == [18] * N


def test_steps_per_execution_above_one_is_refused_under_a_strategy():
    with _strategy().scope():
        pack = kg.ModelPack(_members([8, 8]))
        with pytest.raises(ValueError, match=r"steps_per_execution.*keras-team/keras#19246"):
            pack.compile(optimizer="adam", loss="mse", steps_per_execution=8)
        pack.compile(optimizer="adam", loss="mse")
    assert pack.steps_per_execution == 1
    assert pack.jit_compile is False


def test_new_strategies_one_after_another_as_in_a_notebook():
    # With CPU devices MirroredStrategy's default all-reduce (CollectiveAllReduce) restarts its
    # collective keys with every strategy, so a second strategy's model clashes with the
    # first one's in TensorFlow (plain Keras models too, see docs/scaling.md); a reduction
    # that uses no collectives lets a notebook build one strategy after another.
    x, y = _data()
    reference = {}
    for engine, widths in (("graph", [4, 6, 8]), ("fused", [5, 5, 5])):
        strategy = tf.distribute.MirroredStrategy(
            ["/cpu:2", "/cpu:3"], cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
        with strategy.scope():
            pack = _pack(widths, engine)
        pack.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        alone = _pack(widths, engine)
        alone.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        reference[engine] = (pack, alone)
    for engine, (pack, alone) in reference.items():
        assert pack.engine == engine
        _assert_same_members(pack, alone)


@pytest.mark.parametrize(
    ("cross_device_ops", "outcome"),
    [
        ("collective", "clear error: "),
        ("reduction_to_one_device", "same as without a strategy: "),
    ],
)
def test_a_second_strategy_over_the_same_cpus_says_what_clashed(cross_device_ops, outcome):
    # A graph pack under a first MirroredStrategy, then a fused pack under a second one over
    # the same CPUs (issue 35 item 5): with the default all-reduce the fused pack's fit must
    # name the clash and the ways out, with ReductionToOneDevice it must train as without a
    # strategy. A fresh process each: the clash leaves TensorFlow's collectives aborted, and
    # this file's own strategy uses the same CPUs.
    script = Path(__file__).with_name("second_strategy_script.py")
    result = subprocess.run(
        [sys.executable, str(script), cross_device_ops],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith(outcome), result.stdout
