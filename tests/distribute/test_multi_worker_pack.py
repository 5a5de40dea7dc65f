"""A ModelPack under `MultiWorkerMirroredStrategy`: two worker processes on localhost.

`kg.run_local_workers` starts `multi_worker_script.py` as both workers (TF_CONFIG on
loopback ports), as a user would; each run takes about 15 s on two cores.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from hang_guard import HANG_GUARD_S

import keras_gpushare as kg

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="tf.distribute needs TensorFlow"
)

SCRIPT = Path(__file__).with_name("multi_worker_script.py")
STEPS = 3 * 6  # 3 epochs of 96 samples in global batches of 16


def _run(out: Path, *args: str, max_restarts: int = 0) -> int:
    out.mkdir(exist_ok=True)
    return kg.run_local_workers(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        num_workers=2,
        max_restarts=max_restarts,
        timeout=HANG_GUARD_S,
        log_dir=out / "logs",
    )


def _result(out: Path, worker: int) -> tuple[dict, dict]:
    info = json.loads((out / f"result-w{worker}.json").read_text())
    with np.load(out / f"result-w{worker}.npz") as weights:
        return info, dict(weights)


def _assert_same_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert _run(out, "--engine", "fused") == 0, (out / "logs" / "worker0.log").read_text()[-3000:]
    return out


def test_workers_agree_and_only_the_chief_writes_the_pack(uninterrupted):
    (info0, weights0), (info1, weights1) = _result(uninterrupted, 0), _result(uninterrupted, 1)
    assert info0["engine"] == info1["engine"] == "fused"
    assert info0["steps"] == info1["steps"] == [STEPS] * 3
    assert info0["val_losses"] == info1["val_losses"]
    _assert_same_weights(weights0, weights1)
    # pack.save ran on both workers; only the chief's (worker 0's) file exists.
    assert (uninterrupted / "pack-w0.keras").exists()
    assert not (uninterrupted / "pack-w1.keras").exists()
    assert not list(uninterrupted.glob(".partial-*"))
    loaded = keras.saving.load_model(uninterrupted / "pack.keras")
    for i, member in enumerate(loaded.members):
        for k, w in enumerate(member.get_weights()):
            np.testing.assert_allclose(w, weights0[f"m{i}_{k}"], rtol=1e-6, err_msg=f"m{i}_{k}")
    # predict under the strategy gives every row, in order, on every worker.
    x = np.random.default_rng(0).normal(size=(96, 10)).astype("float32")[:40]
    np.testing.assert_allclose(
        weights0["predictions"], loaded.predict(x, stack=True, verbose=0), rtol=1e-5, atol=1e-6
    )


# `make test-all` only: MemberEarlyStopping is the conformance matrix's (one process), and
# the workers' agreeing on all-reduced logs is the uninterrupted run's.
@pytest.mark.slow
def test_member_early_stopping_is_agreed_across_workers(tmp_path):
    # Member 1's validation loss falls by less than min_delta in its second epoch (0.82,
    # then 0.79), so it stops there; members 0 and 2 go on. Each worker decides from the
    # same all-reduced logs.
    assert _run(tmp_path, "--engine", "graph", "--min-delta", "0.05") == 0
    (info0, weights0), (info1, weights1) = _result(tmp_path, 0), _result(tmp_path, 1)
    assert info0["engine"] == "graph"
    assert info0["status"] == info1["status"] == ["active", "stopped:early", "active"]
    assert info0["steps"] == info1["steps"] == [STEPS, 12, STEPS]
    _assert_same_weights(weights0, weights1)


def test_killed_worker_restarts_and_training_resumes_from_the_backup(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    # Worker 1 of the first attempt kills itself after the third batch of the second epoch.
    code = _run(
        tmp_path / "run",
        "--engine",
        "fused",
        "--backup",
        str(backup),
        "--kill-at",
        "1",
        "1",
        "2",
        max_restarts=1,
    )
    assert code == 0
    killed = json.loads((tmp_path / "run" / "killed-w1.json").read_text())
    assert killed == {"epoch": 1, "batch": 2}
    (info0, weights0), (info1, weights1) = (
        _result(tmp_path / "run", 0),
        _result(tmp_path / "run", 1),
    )
    # The second attempt resumed after epoch 1 (the last backup) and ran epochs 2 and 3.
    assert info0["attempt"] == info1["attempt"] == 1
    assert info0["epochs"] == info1["epochs"] == [1, 2]
    assert info0["steps"] == info1["steps"] == [STEPS] * 3
    _assert_same_weights(weights0, weights1)
    _assert_same_weights(weights0, _result(uninterrupted, 0)[1])
    assert not backup.exists()  # the chief removed its backup at the end of training
