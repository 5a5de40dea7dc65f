import importlib.metadata
import subprocess
import sys

import pytest
from hang_guard import HANG_GUARD_S

import keras_gpushare_cli
from keras_gpushare import cli


def test_console_script_help_runs():
    result = subprocess.run(
        [sys.executable, "-m", "keras_gpushare.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0
    assert "keras-gpushare" in result.stdout


_FRAMEWORKS = ("keras", "tensorflow", "jax", "torch", "keras_gpushare")
_HELP_IMPORTS = """
import sys
import keras_gpushare_cli
try:
    keras_gpushare_cli.main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
print(sorted(name for name in {frameworks} if name in sys.modules))
"""


@pytest.mark.parametrize("command", ["", "bench", "monitor", "plan", "autopack", "workers"])
def test_help_imports_no_framework(command):
    # `keras-gpushare --help` took 8-11 s when it imported the package (and TensorFlow).
    code = _HELP_IMPORTS.format(frameworks=_FRAMEWORKS)
    result = subprocess.run(
        [sys.executable, "-c", code, *command.split(), "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr
    assert f"usage: keras-gpushare {command}".strip() in result.stdout
    assert result.stdout.splitlines()[-1] == "[]"


def test_console_script_is_the_framework_free_parser():
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="keras-gpushare")
    assert script.value == "keras_gpushare_cli:main"
    assert cli.main is keras_gpushare_cli.main


def test_help_lists_every_command(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    for command in ("bench", "monitor", "plan", "autopack", "workers"):
        assert command in out


def test_workers_runs_the_command_as_local_workers(tmp_path):
    code = "import os, json; print(json.loads(os.environ['TF_CONFIG'])['task']['index'])"
    argv = ["workers", "-n", "2", "--log-dir", str(tmp_path), "--", sys.executable, "-c", code]
    assert cli.main(argv) == 0
    assert [(tmp_path / f"worker{i}.log").read_text() for i in range(2)] == ["0\n", "1\n"]


def test_workers_exit_status_is_the_failed_workers(tmp_path):
    argv = ["workers", "--log-dir", str(tmp_path), "--", sys.executable, "-c", "exit(7)"]
    assert cli.main(argv) == 7


def _plan(tmp_path, *options):
    import keras

    path = tmp_path / "mlp.keras"
    keras.Sequential(
        [keras.Input((8,))] + [keras.layers.Dense(4, name=f"d{i}") for i in range(3)]
    ).save(path)
    return subprocess.run(
        [sys.executable, "-m", "keras_gpushare.cli", "plan", str(path), *options],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_plan_over_logical_cpus_made_by_the_command(tmp_path):
    # A fresh process sees one CPU; --logical-cpus makes the second before TensorFlow starts.
    result = _plan(
        tmp_path, "--devices", "/CPU:0,/CPU:1", "--logical-cpus", "2", "--balance", "1,2"
    )
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()[3:]
    assert [row.split()[:3] for row in rows] == [["0", "/CPU:0", "1"], ["1", "/CPU:1", "2"]]
    assert rows[1].endswith("d1 .. d2")


def test_plan_over_missing_devices_names_the_option_that_makes_them(tmp_path):
    result = _plan(tmp_path, "--devices", "/CPU:0,/CPU:1")
    assert result.returncode == 2
    assert "no device /CPU:1" in result.stderr
    assert "--logical-cpus 2" in result.stderr
    assert "share_gpu" not in result.stderr
