import subprocess
import sys

from hang_guard import HANG_GUARD_S

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
