"""Without the fake: this machine's real `pynvml`, and the scripts on JAX without TensorFlow."""

import logging
import os
import subprocess
import sys

import pytest
from hang_guard import HANG_GUARD_S
from monitor_helpers import join_monitor_threads, tiny_data, tiny_model

from keras_gpushare.callbacks import UtilizationLogger

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nvml_works():
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_gpu_less_machine_warns_once_and_logs_host_figures(monkeypatch, caplog):
    if nvml_works():
        pytest.skip("this machine has NVML")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    x, y = tiny_data()
    util_logger = UtilizationLogger(interval=0.05)
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        history = tiny_model().fit(x, y, epochs=2, callbacks=[util_logger], verbose=0)
        tiny_model().fit(x, y, epochs=1, callbacks=[util_logger], verbose=0)  # not again
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "NVML could not start" in warnings[0].getMessage()
    assert set(history.history) == {"loss", "cpu_util", "host_mem_used_mib"}
    assert "no ModelPack advice" in util_logger.advice
    assert not join_monitor_threads()


def run_without_tensorflow(code):
    """Runs `code` with KERAS_BACKEND=jax and `import tensorflow` failing."""
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    prelude = "import sys; sys.modules['tensorflow'] = None; import runpy; "
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_example_runs_on_jax_without_tensorflow():
    result = run_without_tensorflow(
        "runpy.run_path('examples/monitor_fit.py', run_name='__main__')"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "host_mem_used_mib" in result.stdout
    assert "backend: jax" in result.stdout


def test_overhead_benchmark_runs_on_jax_without_tensorflow():
    args = ["b", "--nvml", "fake", "--width", "16", "--steps", "4", "--epochs", "2"]
    args += ["--repeats", "1"]
    result = run_without_tensorflow(
        f"sys.argv = {args}; runpy.run_path('benchmarks/monitor_overhead.py', run_name='__main__')"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "UtilizationLogger(interval=0.05)" in result.stdout
    assert "baseline (no callback)" in result.stdout
