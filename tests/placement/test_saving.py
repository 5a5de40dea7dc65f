"""A placed model round-trips through .keras with its placement; `Plan` and the CLI."""

import keras
import numpy as np
from placement_models import data, skip

import keras_gpushare as kg
from keras_gpushare import cli


def test_keras_round_trip_keeps_placement(tmp_path):
    placed = kg.split_model(skip(), ["/CPU:1", "/CPU:2", "/CPU:3"], [1, 1, 2], microbatches=2)
    placed.compile(optimizer="adam", loss="mse")
    x, y = data("skip")
    placed.fit(x, y, batch_size=8, verbose=0)
    path = tmp_path / "placed.keras"
    placed.save(path)

    loaded = keras.models.load_model(path)
    assert isinstance(loaded, kg.PlacedModel)
    assert loaded.devices == placed.devices
    assert loaded.microbatches == 2
    assert loaded.plan.layer_names == placed.plan.layer_names
    assert [v.value.device[-5:] for v in loaded.weights] == [
        v.value.device[-5:] for v in placed.weights
    ]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), placed.predict(x, verbose=0))
    for a, b in zip(loaded.optimizer.variables, placed.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy())
    # Training resumes identically.
    placed.fit(x, y, batch_size=8, verbose=0)
    loaded.fit(x, y, batch_size=8, verbose=0)
    for a, b in zip(loaded.get_weights(), placed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_plan_table_and_fields():
    placed = kg.split_model(skip(), ["/CPU:1", "/CPU:2"], balance=["add"])
    plan = placed.get_plan(batch_size=64)
    assert plan.devices == ["/CPU:1", "/CPU:2"]
    assert plan.layer_names == [["d1", "d2"], ["add", "out"]]
    assert plan.params == [6 * 8 + 8 + 8 * 8 + 8, 8 * 3 + 3]
    assert all(m > 0 for m in plan.memory_bytes)
    text = str(plan)
    assert "stage" in text and "/CPU:2" in text and "add .. out" in text


def test_cli_plan(tmp_path, capsys):
    path = tmp_path / "m.keras"
    skip().save(path)
    assert cli.main(["plan", str(path), "--devices", "/CPU:0,/CPU:1", "--balance", "2,2"]) == 0
    out = capsys.readouterr().out
    assert "/CPU:1" in out and "add .. out" in out
    assert cli.main(["plan", str(path)]) == 2
    assert "pass --devices" in capsys.readouterr().err
