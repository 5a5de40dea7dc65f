"""Every script in examples/ runs, in its quick mode, so the examples never rot.

Each `examples/*.py` runs as its own process with `KERAS_GPUSHARE_QUICK=1` in the
environment; an example reads it to train on little data for one epoch. New examples are
found automatically.
"""

import os
import pathlib
import subprocess
import sys

import pytest
from hang_guard import HANG_GUARD_S

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
QUICK_ENV = "KERAS_GPUSHARE_QUICK"


# `make test` runs the two entry points' examples (a pack, a tuner); the others run with the
# slow tests (`make test-all`), what each shows being tested in `make test` on its own.
FAST_EXAMPLES = {"pack_basic.py", "tune_parallel.py"}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(p, id=p.name, marks=[] if p.name in FAST_EXAMPLES else pytest.mark.slow)
        for p in EXAMPLES
    ],
)
def test_example_runs_in_quick_mode(script):
    env = dict(os.environ, **{QUICK_ENV: "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    env.pop("KERAS_BACKEND", None)  # each example runs on the backend it chooses
    try:
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script.name} hung: no exit within {HANG_GUARD_S} s with {QUICK_ENV}=1.")
    assert result.returncode == 0, (
        f"{script.name} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-3000:]}"
    )
