"""`TensorBoard(histogram_freq=1)` on a pack writes each member's weight histograms as a fit of
that member alone writes them: the same tags, counts and values."""

import glob
import os

import keras
import numpy as np
import pytest
from pack_builders import copy_model, mlp

import keras_gpushare as kg

tf = pytest.importorskip("tensorflow")
pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorBoard event files of the TF backend"
)


def histograms(log_dir):
    """`{tag: [(step, count, min, max), ...]}` of a run's weight histograms (train folder)."""
    result = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "train", "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.endswith("/histogram"):
                    buckets = tf.make_ndarray(value.tensor)  # rows of (left, right, count)
                    figures = (buckets[:, 2].sum(), buckets[0, 0], buckets[-1, 1])
                    result.setdefault(value.tag, []).append((event.step, *figures))
    return result


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "graph"])
def test_histograms_are_each_members_own(fuse, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    members = [
        mlp(8, inputs=4, seed=0, name="a", out=None),
        mlp(12, inputs=4, seed=1, name="b", out=None),
    ]
    twins = [copy_model(m) for m in members]
    fit = {"epochs": 2, "batch_size": 16, "shuffle": False, "verbose": 0}

    pack = kg.ModelPack(members, fuse=fuse)
    pack.compile(optimizer="sgd", loss="mse")
    board = keras.callbacks.TensorBoard(str(tmp_path / "pack"), histogram_freq=1)
    pack.fit(x, y, callbacks=[board], **fit)
    assert pack.engine == ("fused" if fuse else "graph")
    assert board.model is pack  # the user's callback saw the fit

    expected = {}
    for i, twin in enumerate(twins):
        twin.compile(optimizer="sgd", loss="mse")
        log_dir = str(tmp_path / f"alone{i}")
        twin.fit(x, y, callbacks=[keras.callbacks.TensorBoard(log_dir, histogram_freq=1)], **fit)
        expected |= histograms(log_dir)

    written = histograms(str(tmp_path / "pack"))
    assert sorted(written) == sorted(expected)  # a/dense/kernel/histogram, ..., b/dense_3/...
    for tag, runs in expected.items():
        np.testing.assert_allclose(written[tag], runs, atol=1e-5, err_msg=tag)
