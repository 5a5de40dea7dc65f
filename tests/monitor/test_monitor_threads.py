"""The sampler thread ends after fit, at the next fit after one that raised, at exit; 100 fits
leak none; it never reads another thread's frames."""

import gc
import math
import os
import subprocess
import sys
import textwrap
import threading

import keras
import pytest
from fake_nvml import h100s
from hang_guard import HANG_GUARD_S
from monitor_helpers import join_monitor_threads, monitor_threads, tiny_data, tiny_model

from keras_gpushare.callbacks import UtilizationLogger

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Boom(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("boom")


def test_thread_ends_at_train_end(fake_nvml):
    fake_nvml(h100s(1))
    before = monitor_threads()
    x, y = tiny_data()
    tiny_model().fit(x, y, epochs=1, callbacks=[UtilizationLogger(interval=0.02)], verbose=0)
    assert monitor_threads() == before == []  # joined in on_train_end, no waiting needed


def test_a_fit_that_raised_leaves_its_sampler_to_the_next_fit_which_starts_clean(fake_nvml):
    fake = fake_nvml(h100s(1))
    util_logger = UtilizationLogger(interval=0.02)
    model = tiny_model()
    x, y = tiny_data()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=8, epochs=2, callbacks=[util_logger, Boom()], verbose=0)
    # on_train_end never ran (Keras's fit has no try/finally): at most the one sampler is left.
    assert len(monitor_threads()) <= 1

    history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[util_logger], verbose=0)
    assert len(history.history["gpu0_util"]) == 2
    assert not monitor_threads()
    assert fake.inits == fake.shutdowns == 2


def test_the_sampler_never_reads_another_threads_frames(fake_nvml, monkeypatch):
    # Sampling threads that walk another thread's frames crash CPython 3.11 now and then.
    fake_nvml(h100s(1))
    touched = []
    real = sys._current_frames

    def spy():
        touched.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(sys, "_current_frames", spy)
    x, y = tiny_data()
    tiny_model().fit(x, y, epochs=2, callbacks=[UtilizationLogger(interval=0.01)], verbose=0)
    assert not [name for name in touched if "keras-gpushare" in name]


def test_leftover_sampler_is_stopped_at_next_train_begin(fake_nvml):
    # A thread still running when training begins again (the fit that raised was moments
    # ago) is stopped first, so there is never more than one.
    fake = fake_nvml(h100s(1))
    util_logger = UtilizationLogger(interval=5.0)
    util_logger.set_model(tiny_model())
    util_logger.on_train_begin()
    first = monitor_threads()
    assert len(first) == 1
    util_logger.on_train_begin()
    assert not first[0].is_alive()
    assert len(monitor_threads()) == 1
    util_logger.on_train_end()
    assert not monitor_threads()
    assert fake.inits == fake.shutdowns == 2


# A thread left by each fit shows after three; the hundred fits run with the slow tests.
@pytest.mark.parametrize("fits", [3, pytest.param(100, marks=pytest.mark.slow)])
def test_fits_leak_no_thread(fake_nvml, fits):
    fake = fake_nvml(h100s(1))
    baseline = {t.ident for t in __import__("threading").enumerate()}
    model = tiny_model()
    x, y = tiny_data(8)
    util_logger = UtilizationLogger(interval=0.05, advise=False)
    for _ in range(fits):
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[util_logger], verbose=0)
    assert not monitor_threads()
    leaked = [
        t.name
        for t in __import__("threading").enumerate()
        if t.ident not in baseline and "keras-gpushare" in t.name
    ]
    assert not leaked
    assert fake.inits == fake.shutdowns == fits


def test_interpreter_exit_stops_a_running_sampler(tmp_path):
    # A sampler nobody stopped: the atexit hook stops it and NVML is shut down.
    script = textwrap.dedent(
        f"""
        import atexit, sys
        sys.path[:0] = [{HERE!r}, {ROOT!r}]
        from fake_nvml import FakeNvml, h100s
        fake = FakeNvml(h100s(1))
        sys.modules["pynvml"] = fake.module
        # atexit runs last-registered first: this reports after the monitor's hook ran.
        atexit.register(lambda: print("shutdowns", fake.shutdowns, flush=True))
        from keras_gpushare.monitor.nvml import NvmlReader
        from keras_gpushare.monitor.sampler import Sampler
        sampler = Sampler(NvmlReader(), interval=0.01)
        sampler.start()
        sampler.take("epoch")
        print("alive", sampler.alive, flush=True)
        """
    )
    env = dict(os.environ, KERAS_BACKEND="jax")
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "alive True" in result.stdout
    assert "shutdowns 1" in result.stdout


# A sampler left by each fit that raised shows from the second; fifty run with the slow tests.
@pytest.mark.parametrize("fits", [3, pytest.param(50, marks=pytest.mark.slow)])
def test_fits_that_raise_each_with_a_new_logger_leave_at_most_one_sampler(fake_nvml, fits):
    # Each logger is kept (a KerasTuner trial's copy may be too): only the rule of the next
    # on_train_begin bounds the threads, not the loggers' collection.
    fake = fake_nvml(h100s(1))
    model = tiny_model()
    x, y = tiny_data()
    loggers = []
    for _ in range(fits):
        loggers.append(UtilizationLogger(interval=0.05, advise=False))
        with pytest.raises(RuntimeError, match="boom"):
            model.fit(x, y, batch_size=8, epochs=2, callbacks=[loggers[-1], Boom()], verbose=0)
        assert len(monitor_threads()) <= 1
    history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[loggers[-1]], verbose=0)
    assert len(history.history["gpu0_util"]) == 2
    assert not monitor_threads()
    assert fake.inits == fake.shutdowns == fits + 1


def test_a_sampler_stops_when_its_logger_is_collected(fake_nvml):
    fake = fake_nvml(h100s(1))
    util_logger = UtilizationLogger(interval=5.0)
    util_logger.set_model(tiny_model())
    util_logger.on_train_begin()  # as in a fit that raised: on_train_end never runs
    assert len(monitor_threads()) == 1
    del util_logger
    gc.collect()
    assert not join_monitor_threads()
    assert fake.inits == fake.shutdowns == 1


def test_a_fit_inside_a_monitored_fit_leaves_the_outer_sampler_running(fake_nvml):
    # A callback that runs a whole fit of another model: the outer fit is still running
    # when the inner one begins (deeper on the same thread), so its sampler goes on.
    fake_nvml(h100s(1))
    x, y = tiny_data()
    outer = UtilizationLogger(interval=0.02, advise=False)
    inner_history = []

    class InnerFit(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            inner = UtilizationLogger(interval=0.02, advise=False)
            history = tiny_model().fit(x, y, epochs=1, callbacks=[inner], verbose=0)
            inner_history.append(history.history["gpu0_util"])
            assert len(monitor_threads()) == 1  # the outer sampler

    history = tiny_model().fit(x, y, epochs=2, callbacks=[outer, InnerFit()], verbose=0)
    assert len(inner_history) == 2
    assert all(math.isfinite(v) for v in history.history["gpu0_util"])
    assert not monitor_threads()


def test_a_fit_that_raised_on_an_ended_thread_is_stopped_by_the_next_fit(fake_nvml):
    fake = fake_nvml(h100s(1))
    x, y = tiny_data()
    kept = []  # the logger outlives its thread, as a tuner's trial record may keep it

    def failing_fit():
        kept.append(UtilizationLogger(interval=0.05))
        with pytest.raises(RuntimeError, match="boom"):
            tiny_model().fit(x, y, batch_size=8, callbacks=[kept[0], Boom()], verbose=0)

    worker = threading.Thread(target=failing_fit)
    worker.start()
    worker.join(HANG_GUARD_S)
    assert kept and len(monitor_threads()) == 1
    tiny_model().fit(x, y, epochs=1, callbacks=[UtilizationLogger(interval=0.05)], verbose=0)
    assert not monitor_threads()
    assert fake.inits == fake.shutdowns == 2
