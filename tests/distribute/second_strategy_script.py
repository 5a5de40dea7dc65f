"""A second `MirroredStrategy` over the same CPUs in one process (run by a test, never by pytest).

A graph-engine pack trains under a first `MirroredStrategy(["/CPU:0", "/CPU:1"])`, then a
fused pack (3 members 10-32-32-1, SGD) under a second one over the same devices, with
`cross_device_ops` given by the argument:

- `collective` (the default all-reduce): the two strategies' collective all-reduces clash and
  the fused pack's `fit` must say so, with the ways out;
- `reduction_to_one_device`: the fused pack must train and end where the same pack ends
  without a strategy.

The last line printed says which check passed. Each case needs a fresh process: after the
clash TensorFlow's collectives stay aborted until the process ends.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(2)]
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_gpushare as kg  # noqa: E402

DEVICES = ["/CPU:0", "/CPU:1"]
WAY_OUT = (
    r"second `MirroredStrategy` over the same devices.*one strategy per process.*"
    r"cross_device_ops=tf\.distribute\.ReductionToOneDevice\(\).*docs/scaling\.md"
)


def _mlp(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def _pack(engine: str) -> kg.ModelPack:
    pack = kg.ModelPack([_mlp(i) for i in range(3)], fuse=engine == "fused")
    pack.compile(optimizer=[keras.optimizers.SGD(0.01) for _ in range(3)], loss="mse")
    return pack


def _fit(pack: kg.ModelPack, x: np.ndarray, y: np.ndarray) -> None:
    pack.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)


def main(case: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 10)).astype("float32")
    y = x[:, :3].sum(axis=1, keepdims=True)
    with tf.distribute.MirroredStrategy(DEVICES).scope():
        first = _pack("graph")
    _fit(first, x, y)
    cross_device_ops = {
        "collective": None,
        "reduction_to_one_device": tf.distribute.ReductionToOneDevice(),
    }[case]
    with tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=cross_device_ops).scope():
        pack = _pack("fused")
    assert pack.engine == "fused"
    if case == "collective":
        with pytest.raises(tf.errors.InvalidArgumentError, match=WAY_OUT) as raised:
            _fit(pack, x, y)
        assert "Shape mismatch in the collective instance" in str(raised.value.__cause__)
        sys.stdout.write(f"clear error: {str(raised.value).splitlines()[0][:120]}\n")
        return
    _fit(pack, x, y)
    alone = _pack("fused")
    _fit(alone, x, y)
    difference = 0.0
    for i, (got, want) in enumerate(zip(pack.members, alone.members)):
        for a, b in zip(got.get_weights(), want.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"member {i}")
            difference = max(difference, float(np.max(np.abs(a - b))))
    sys.stdout.write(f"same as without a strategy: max difference {difference:.3g}\n")


if __name__ == "__main__":
    main(sys.argv[1])
