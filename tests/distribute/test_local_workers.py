"""`kg.run_local_workers`: TF_CONFIG per worker, restarts of the whole group, errors."""

import json
import sys

import pytest

import keras_gpushare as kg
from keras_gpushare.workers import tf_config


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_each_worker_gets_its_own_tf_config(tmp_path):
    code = (
        "import json, os, pathlib; c = json.loads(os.environ['TF_CONFIG']); "
        f"pathlib.Path(r'{tmp_path}', f\"w{{c['task']['index']}}.json\").write_text("
        "os.environ['TF_CONFIG'])"
    )
    assert kg.run_local_workers(_python(code), num_workers=3, log_dir=tmp_path / "logs") == 0
    configs = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(3)]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    for i, config in enumerate(configs):
        assert config == {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}}


def test_a_failed_worker_restarts_the_whole_group(tmp_path):
    # Worker 1 fails on the first attempt; every worker logs each start.
    code = (
        "import os, sys, json; i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
        "a = os.environ['KERAS_GPUSHARE_ATTEMPT']; print(f'start {i} {a}'); "
        "sys.exit(3 if (i, a) == (1, '0') else 0)"
    )
    logs = tmp_path / "logs"
    assert kg.run_local_workers(_python(code), max_restarts=2, log_dir=logs) == 0
    assert (logs / "worker0.log").read_text().split("\n")[:2] == ["start 0 0", "start 0 1"]
    assert "start 1 1" in (logs / "worker1.log").read_text()


def test_without_restarts_left_the_failed_status_is_returned(tmp_path):
    code = "import sys; sys.exit(5)"
    assert kg.run_local_workers(_python(code), max_restarts=1, log_dir=tmp_path) == 5
    assert (tmp_path / "worker0.log").exists()


def test_output_is_forwarded_with_the_worker_prefix(capfd):
    code = "import os, json; print(json.loads(os.environ['TF_CONFIG'])['task']['index'])"
    assert kg.run_local_workers(_python(code), num_workers=2) == 0
    assert sorted(capfd.readouterr().out.splitlines()) == ["[worker0] 0", "[worker1] 1"]


def test_timeout_stops_every_worker(tmp_path):
    with pytest.raises(TimeoutError, match="within the timeout"):
        kg.run_local_workers(_python("import time; time.sleep(60)"), timeout=1.0, log_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"command": "python train.py"}, "`command`.*list"),
        ({"command": []}, "`command`"),
        ({"num_workers": 0}, "`num_workers`.*>= 1"),
        ({"max_restarts": -1}, "`max_restarts`.*>= 0"),
        ({"timeout": 0}, "`timeout`"),
    ],
)
def test_bad_arguments_are_refused_before_any_start(kwargs, match):
    kwargs = {"command": _python("pass"), **kwargs}
    with pytest.raises(ValueError, match=match):
        kg.run_local_workers(**kwargs)


def test_tf_config_refuses_an_index_outside_the_cluster():
    with pytest.raises(ValueError, match="index 2.*2 workers"):
        tf_config(["a:1", "b:2"], 2)
