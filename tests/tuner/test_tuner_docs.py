"""The tuner's documented examples run as written: docstrings and docs/tuner.md's first one."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from hang_guard import HANG_GUARD_S

import keras_gpushare as kg

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("obj", [kg.tuner.ParallelOracle, kg.tuner.ParallelTuner])
def test_docstring_example_runs(obj, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", obj.__doc__, flags=re.S)
    assert blocks
    code = "\n".join(
        line[4:] if line.startswith("    ") else line for line in blocks[0].split("\n")
    )
    exec(compile(code, f"<{obj.__name__} docstring>", "exec"), {})


def test_the_first_example_of_the_tuner_page_runs_as_written(tmp_path):
    """KerasTuner's default verbose=1 with 4 trials per round prints every trial (item 12)."""
    page = (ROOT / "docs" / "tuner.md").read_text()
    code = re.findall(r"```python\n(.*?)```", page, flags=re.S)[0]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("Search: Running Trial #") == 8
    assert sorted(int(n) for n in re.findall(r"Trial (\d+) Complete", out)) == list(range(1, 9))
    assert "Results summary" in out
    assert (tmp_path / "tuning" / "mlp" / "oracle.json").exists()
