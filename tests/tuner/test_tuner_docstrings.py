"""The Example sections of the tuner's public docstrings run as written."""

import re

import pytest

import keras_gpushare as kg


@pytest.mark.parametrize("obj", [kg.tuner.ParallelOracle, kg.tuner.ParallelTuner])
def test_docstring_example_runs(obj, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", obj.__doc__, flags=re.S)
    assert blocks
    code = "\n".join(
        line[4:] if line.startswith("    ") else line for line in blocks[0].split("\n")
    )
    exec(compile(code, f"<{obj.__name__} docstring>", "exec"), {})
