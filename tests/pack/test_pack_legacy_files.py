"""`.keras` files saved by earlier releases still load, with their weights and optimizer state.

`data/legacy_*_pack.keras` were written by keras-gpushare at commit 03190d0 (one fused and one
graph-engine pack, each trained one epoch); the `.npz` beside each holds what those packs'
members had: weights, optimizer variables and predictions on the first 8 samples.
"""

import os

import keras
import numpy as np
import pytest

import keras_gpushare as kg

DATA = os.path.join(os.path.dirname(__file__), "data")
pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the files were written on TensorFlow"
)


@pytest.mark.parametrize("engine", ["fused", "graph"])
def test_files_of_an_earlier_release_load_and_keep_training(engine):
    expected = np.load(os.path.join(DATA, f"legacy_{engine}_pack.npz"))
    pack = keras.models.load_model(os.path.join(DATA, f"legacy_{engine}_pack.keras"))
    assert isinstance(pack, kg.ModelPack) and pack.engine == engine
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, :2].sum(1, keepdims=True) > 0).astype("float32")
    for i, member in enumerate(pack.members):
        for k, weight in enumerate(member.get_weights()):
            np.testing.assert_allclose(weight, expected[f"w{i}_{k}"], rtol=1e-6, atol=1e-7)
        for k, variable in enumerate(member.optimizer.variables):
            np.testing.assert_allclose(
                keras.ops.convert_to_numpy(variable), expected[f"opt{i}_{k}"], rtol=1e-6
            )
    for i, prediction in enumerate(pack.predict(x[:8], verbose=0)):
        np.testing.assert_allclose(prediction, expected[f"pred{i}"], rtol=1e-5, atol=1e-6)
    history = pack.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][0])
    assert [int(m.optimizer.iterations) for m in pack.members] == [8, 8]
