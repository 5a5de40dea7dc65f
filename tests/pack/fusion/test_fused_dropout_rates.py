"""Members that differ only in their dropout rate still fuse, each with its own rate."""

import keras
import numpy as np
from keras import ops

import keras_gpushare as kg
from keras_gpushare.pack.fusion import build_fused_model, fusion_report


def member(rate, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(256),
            keras.layers.Dropout(rate),
            keras.layers.Dense(1),
        ]
    )


def test_members_with_different_dropout_rates_fuse():
    members = [member(r, s) for s, r in enumerate((0.0, 0.2, 0.6))]
    assert fusion_report(members).fusable
    assert kg.ModelPack(members).engine == "fused"
    other = [member(0.2, 0), keras.Sequential([keras.Input((256,)), keras.layers.Dense(3)])]
    assert not fusion_report(other).fusable


def test_each_member_drops_at_its_own_rate_and_rescales():
    rates = (0.0, 0.2, 0.6)
    fused = build_fused_model([member(r, s) for s, r in enumerate(rates)])
    dropout = next(layer for layer in fused.graph.layers if "dropout" in layer.name)
    x = ops.ones((3, 400, 256))
    y = ops.convert_to_numpy(dropout(x, training=True))
    for i, rate in enumerate(rates):
        kept = y[i] != 0
        assert abs(1 - kept.mean() - rate) < 0.01
        np.testing.assert_allclose(y[i][kept], 1 / (1 - rate), rtol=1e-5)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(dropout(x, training=False)), np.ones((3, 400, 256))
    )


def test_rates_survive_saving(tmp_path):
    members = [member(r, s) for s, r in enumerate((0.1, 0.5))]
    fused = build_fused_model(members)
    path = str(tmp_path / "fused.keras")
    fused.save(path)
    reloaded = keras.models.load_model(path)
    dropout = next(layer for layer in reloaded.graph.layers if "dropout" in layer.name)
    assert dropout.rates == [0.1, 0.5]


def test_fusion_signature_groups_what_can_fuse():
    from keras_gpushare.pack.fusion.converter import fusion_signature

    a, b = member(0.1, 0), member(0.5, 1)
    assert fusion_signature(a) == fusion_signature(b)
    wider = keras.Sequential([keras.Input((256,)), keras.layers.Dense(128), keras.layers.Dense(1)])
    assert fusion_signature(wider) != fusion_signature(a)
    assert fusion_signature(keras.Sequential([keras.layers.Dense(1)])) is None
