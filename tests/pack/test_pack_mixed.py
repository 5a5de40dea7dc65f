"""Packs of several engines: fused groups beside each other, and the graph engine beside them.

Each member must end where the same model trained alone ends, whatever group it landed in;
a saved pack reloads with the same groups and goes on training. Backend-neutral where no
graph member is involved (the Makefile reruns this file on JAX).
"""

import keras
import numpy as np
import pytest
from pack_builders import Subclassed, assert_weights_close, copy_model, mlp, subclassed

import keras_gpushare as kg

TENSORFLOW = keras.backend.backend() == "tensorflow"


def _optimizers():
    return [
        keras.optimizers.Adam(0.01),
        keras.optimizers.SGD(0.05, momentum=0.9),
        keras.optimizers.Adam(0.003),
        keras.optimizers.RMSprop(0.01),
        keras.optimizers.Adam(0.02),
    ]


def _members(with_graph_member):
    members = [mlp(8, seed=0), mlp(8, seed=1), mlp(12, seed=2), mlp(12, seed=3)]
    members.append(subclassed(seed=4) if with_graph_member else mlp(6, seed=4))
    return members


def _fit(model, x, y, epochs=2):
    return model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)


@pytest.mark.parametrize("with_graph_member", [False, True], ids=["fused-groups", "mixed"])
def test_each_member_of_a_multi_engine_pack_matches_training_alone(
    binary_data, with_graph_member, tmp_path
):
    if with_graph_member and not TENSORFLOW:
        pytest.skip("the graph engine runs on TensorFlow only")
    x, y = binary_data
    members = _members(with_graph_member)
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members, fuse=True if not with_graph_member else "auto")
    pack.compile(optimizer=_optimizers(), loss="binary_crossentropy", metrics=["accuracy"])
    assert pack.engine == ("mixed" if with_graph_member else "fused")
    history = _fit(pack, x, y)
    for i, (twin, optimizer) in enumerate(zip(twins, _optimizers())):
        twin.compile(optimizer=optimizer, loss="binary_crossentropy", metrics=["accuracy"])
        alone = _fit(twin, x, y)
        assert_weights_close(pack.members[i], twin)
        for key in alone.history:
            np.testing.assert_allclose(
                history.history[f"m{i}_{key}"], alone.history[key], rtol=1e-4, err_msg=key
            )
    path = tmp_path / "pack.keras"
    pack.save(path)
    loaded = keras.models.load_model(path, custom_objects={"Subclassed": Subclassed})
    assert loaded.engine == pack.engine
    assert str(loaded.fusion_report).splitlines()[0] == str(pack.fusion_report).splitlines()[0]
    _fit(loaded, x, y, epochs=1)
    for i, twin in enumerate(twins):
        _fit(twin, x, y, epochs=1)
        assert_weights_close(loaded.members[i], twin)
