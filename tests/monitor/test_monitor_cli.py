"""`keras-gpushare monitor`: a live table per device, or a clear message without a GPU."""

import pytest
from fake_nvml import h100s

from keras_gpushare import cli


def test_monitor_prints_one_line_per_device_and_sample(fake_nvml, capsys):
    gpus = h100s(2, gpm=True)
    fake = fake_nvml(gpus)
    assert cli.main(["monitor", "--count", "3", "--interval", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["#", "gpu", "nvml", "sm", "mem", "used", "free", "pwr"] + [
        "temp",
        "smact",
    ]
    assert lines[1].startswith("#")
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 6
    assert [r[0] for r in rows] == ["0", "1"] * 3
    assert [int(r[2]) for r in rows[::2]] == fake.values(gpus[0].uuid, "util")
    assert rows[0][-1] == "-" and rows[2][-1] != "-"  # SM activity needs two GPM samples
    assert fake.inits == fake.shutdowns == 1


def test_monitor_without_gpu_exits_non_zero_with_a_message(monkeypatch, capsys):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    import pynvml  # the real binding: this machine has no NVIDIA driver

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    assert cli.main(["monitor", "--count", "1"]) == 1
    captured = capsys.readouterr()
    assert "no GPU to monitor" in captured.err and "NVML" in captured.err
    assert captured.out == ""


def test_monitor_gpu_lost_ends_the_table(fake_nvml, capsys):
    fake = fake_nvml(h100s(1))
    fake.fail(fake.gpus[0].uuid, "nvmlDeviceGetTemperature", after=1)
    assert cli.main(["monitor", "--count", "5", "--interval", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "stopped answering NVML" in lines[-1]


@pytest.mark.parametrize("argv", [["--interval", "0"], ["--count", "0"], ["--count", "x"]])
def test_monitor_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["monitor", *argv])
    assert exit_info.value.code == 2
    assert "monitor" in capsys.readouterr().err


def test_help_lists_monitor(capsys):
    assert cli.main([]) == 2
    assert "monitor" in capsys.readouterr().out
