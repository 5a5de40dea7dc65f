import subprocess
import sys

from keras_gpushare import cli


def test_help_lists_commands(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert "bench" in out


def test_console_script_help_runs():
    result = subprocess.run(
        [sys.executable, "-m", "keras_gpushare.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    assert "keras-gpushare" in result.stdout
