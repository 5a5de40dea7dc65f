"""docs/tuner.md's first example runs as written (the docstrings' examples run in
tests/test_docstring_examples.py)."""

import os
import pathlib
import re
import subprocess
import sys

from hang_guard import HANG_GUARD_S

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
