"""UtilizationLogger under real `fit` runs, NVML faked in `sys.modules`: exact figures."""

import copy
import csv
import logging
import math

import keras
import pytest
from fake_nvml import MIB, NVML_ERROR_NOT_SUPPORTED, FakeGpu, h100s
from monitor_helpers import join_monitor_threads, tiny_data, tiny_model

from keras_gpushare.callbacks import UtilizationLogger
from keras_gpushare.monitor import sampler as sampler_module

GPU_SUFFIXES = ("util", "util_max", "mem_used_mib", "mem_util", "power_w", "temp_c")
HOST_KEYS = ("cpu_util", "host_mem_used_mib")


class Recorder(keras.callbacks.Callback):
    """Placed after the logger: keeps each epoch's (and batch's) logs and samples."""

    def __init__(self, util_logger):
        super().__init__()
        self.util_logger = util_logger
        self.epochs = []
        self.batches = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((dict(logs), list(self.util_logger.epoch_samples)))

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((batch, dict(logs), list(self.util_logger.batch_samples)))


def fit(util_logger, *more, epochs=3, steps=3, batch_size=8):
    x, y = tiny_data(steps * batch_size)
    recorder = Recorder(util_logger)
    history = tiny_model().fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        callbacks=[util_logger, *more, recorder],
        verbose=0,
    )
    return history, recorder


def present(samples, key):
    return [s[key] for s in samples if key in s and not math.isnan(s[key])]


def expected_figures(samples, device_keys, gpm_keys=(), last_proc=math.nan):
    """What the logger must write, computed from the raw samples of the window;
    `last_proc`: the last process-memory reading before the window."""
    out = {}
    for g in device_keys:
        util = present(samples, f"{g}_util")
        out[f"{g}_util"] = sum(util) / len(util)
        out[f"{g}_util_max"] = max(util)
        out[f"{g}_mem_used_mib"] = max(present(samples, f"{g}_mem_used_mib"))
        mem_util = present(samples, f"{g}_mem_util")
        out[f"{g}_mem_util"] = sum(mem_util) / len(mem_util)
        power = present(samples, f"{g}_power_w")
        out[f"{g}_power_w"] = sum(power) / len(power)
        out[f"{g}_temp_c"] = max(present(samples, f"{g}_temp_c"))
    for g in gpm_keys:
        sm = present(samples, f"{g}_sm_active")
        out[f"{g}_sm_active"] = sum(sm) / len(sm) if sm else math.nan
    proc = present(samples, "proc_gpu_mem_mib")
    out["proc_gpu_mem_mib"] = max(proc) if proc else last_proc
    return out


def last_proc_reading(samples, before):
    """The last process-memory reading in `samples`, `before` when they hold none."""
    readings = [s["proc_gpu_mem_mib"] for s in samples if "proc_gpu_mem_mib" in s]
    return readings[-1] if readings else before


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-12)


def test_epoch_figures_equal_those_of_the_fake_samples(fake_nvml):
    gpus = h100s(2)
    gpus[1].gpm = True
    fake = fake_nvml(gpus)
    util_logger = UtilizationLogger(interval=0.02)
    history, recorder = fit(util_logger, epochs=4)

    keys0 = set(recorder.epochs[0][0])
    last_proc = math.nan
    for logs, samples in recorder.epochs:
        assert samples, "every epoch window has at least one sample"
        assert set(logs) == keys0, "the same keys every epoch"
        want = expected_figures(samples, ["gpu0", "gpu1"], gpm_keys=["gpu1"], last_proc=last_proc)
        for key, value in want.items():
            assert same(logs[key], value), key
        last_proc = last_proc_reading(samples, last_proc)
        assert math.isfinite(logs["host_mem_used_mib"])
    assert "gpu1_sm_active" in keys0 and "gpu0_sm_active" not in keys0  # GPM on GPU 1 only
    for key in [f"gpu{i}_{s}" for i in (0, 1) for s in GPU_SUFFIXES] + list(HOST_KEYS):
        assert key in keys0
    assert history.history["gpu0_util"] == [logs["gpu0_util"] for logs, _ in recorder.epochs]

    # The windows' samples are exactly, in order, what NVML returned: none lost or doubled.
    samples = [s for _, window in recorder.epochs for s in window]
    for i, gpu in enumerate(gpus):
        util = [s[f"gpu{i}_util"] for s in samples]
        assert util == fake.values(gpu.uuid, "util")[: len(util)]
        used = [s[f"gpu{i}_mem_used_mib"] for s in samples]
        assert used == [v / MIB for v in fake.values(gpu.uuid, "mem_used")[: len(used)]]
        power = [s[f"gpu{i}_power_w"] for s in samples]
        assert power == [v / 1000 for v in fake.values(gpu.uuid, "power_mw")[: len(power)]]
    sm = present(samples, "gpu1_sm_active")
    assert math.isnan(samples[0]["gpu1_sm_active"])  # GPM needs two samples
    assert sm == fake.values(gpus[1].uuid, "sm_active")[: len(sm)]
    # proc memory: this PID's entries summed over both GPUs (the other PID is left out).
    proc = [s["proc_gpu_mem_mib"] for s in samples if "proc_gpu_mem_mib" in s]
    own = zip(fake.values(gpus[0].uuid, "proc_mem"), fake.values(gpus[1].uuid, "proc_mem"))
    assert proc and proc == [(a + b) / MIB for a, b in own][: len(proc)]
    assert not join_monitor_threads()
    assert fake.inits == fake.shutdowns == 1


def test_csv_logger_and_tensorboard_get_every_figure(fake_nvml, tmp_path):
    fake = fake_nvml(h100s(1))
    fake.fail(fake.gpus[0].uuid, "nvmlDeviceGetTemperature", after=1, code=NVML_ERROR_NOT_SUPPORTED)
    util_logger = UtilizationLogger(interval=0.02)
    csv_path = tmp_path / "log.csv"
    _, recorder = fit(
        util_logger,
        keras.callbacks.CSVLogger(str(csv_path)),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
        epochs=3,
    )
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    for key in [f"gpu0_{s}" for s in GPU_SUFFIXES] + ["proc_gpu_mem_mib", *HOST_KEYS]:
        assert key in rows[0]
        assert all(row[key] not in ("", "NA") for row in rows), key
    # A field the GPU stops reporting stays as a column, with NaN, not a missing key.
    assert rows[-1]["gpu0_temp_c"] == "nan"
    assert float(rows[0]["gpu0_util"]) == pytest.approx(recorder.epochs[0][0]["gpu0_util"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "train"), size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags()["tensors"]) | set(events.Tags()["scalars"])
    for key in ("gpu0_util", "gpu0_util_max", "gpu0_mem_used_mib", "cpu_util"):
        assert f"epoch_{key}" in tags


def test_every_k_batches_writes_batch_logs(fake_nvml):
    fake_nvml(h100s(1))
    util_logger = UtilizationLogger(interval=0.02, every=2)
    _, recorder = fit(util_logger, epochs=2, steps=4)
    with_figures = [(b, logs, s) for b, logs, s in recorder.batches if "gpu0_util" in logs]
    assert [b for b, _, _ in with_figures] == [1, 3, 1, 3]
    last_proc = math.nan
    for _, logs, samples in with_figures:  # batch windows follow one another from train begin
        want = expected_figures(samples, ["gpu0"], last_proc=last_proc)
        for key, value in want.items():
            assert same(logs[key], value), key
        last_proc = last_proc_reading(samples, last_proc)
    assert all("gpu0_util" in logs for logs, _ in recorder.epochs)


def test_gpu_lost_mid_run_warns_once_and_fit_goes_on(fake_nvml, caplog):
    fake = fake_nvml(h100s(1))
    fake.fail(fake.gpus[0].uuid, "nvmlDeviceGetUtilizationRates", after=1)
    util_logger = UtilizationLogger(interval=0.02)
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        history, recorder = fit(util_logger, epochs=4)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "stopped answering NVML" in warnings[0].getMessage()
    assert warnings[0].name.startswith("keras_gpushare.monitor")
    assert len(history.history["loss"]) == 4
    keys0 = set(recorder.epochs[0][0])
    for logs, _ in recorder.epochs:
        assert set(logs) == keys0
    # Every epoch has a sample, so the second GPU reading (which fails) is over by epoch 2.
    for logs, _ in recorder.epochs[2:]:
        assert all(math.isnan(logs[f"gpu0_{s}"]) for s in GPU_SUFFIXES)
        assert math.isnan(logs["proc_gpu_mem_mib"])
        assert math.isfinite(logs["host_mem_used_mib"])
    assert fake.inits == fake.shutdowns == 1


def test_unsupported_fields_are_nan_without_warning(fake_nvml, caplog):
    fake = fake_nvml(h100s(1))
    fake.fail(fake.gpus[0].uuid, "nvmlDeviceGetPowerUsage", code=NVML_ERROR_NOT_SUPPORTED)
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        _, recorder = fit(UtilizationLogger(interval=0.02), epochs=2)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for logs, _ in recorder.epochs:
        assert math.isnan(logs["gpu0_power_w"])
        assert math.isfinite(logs["gpu0_util"])
    assert fake.calls[(fake.gpus[0].uuid, "nvmlDeviceGetPowerUsage")] == 1  # not asked again


@pytest.mark.parametrize("code", [9, 4, 12], ids=["no-driver", "no-permission", "no-library"])
def test_nvml_that_cannot_start_gives_one_warning_and_host_figures(fake_nvml, caplog, code):
    fake_nvml(h100s(1), init_error=code)
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        history, recorder = fit(UtilizationLogger(interval=0.02), epochs=2)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no GPU figures" in warnings[0].getMessage()
    assert {k for k in recorder.epochs[0][0] if k != "loss"} == set(HOST_KEYS)
    assert len(history.history["host_mem_used_mib"]) == 2
    assert not join_monitor_threads()


def test_missing_pynvml_module_gives_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        _, recorder = fit(UtilizationLogger(interval=0.02), epochs=1)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "nvidia-ml-py" in warnings[0].getMessage()
    assert set(HOST_KEYS) <= set(recorder.epochs[0][0])


def test_sampler_exception_is_handed_to_the_training_thread(fake_nvml, caplog):
    fake = fake_nvml(h100s(1))

    def broken(handle):
        raise RuntimeError("binding broke")

    fake.module.nvmlDeviceGetPowerUsage = broken
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        history, recorder = fit(UtilizationLogger(interval=0.02), epochs=2)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "sampler thread failed (RuntimeError: binding broke)" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None  # the thread's traceback comes along
    assert len(history.history["loss"]) == 2
    assert set(recorder.epochs[0][0]) == set(recorder.epochs[1][0])
    assert fake.inits == fake.shutdowns == 1


def test_process_memory_carries_the_last_reading_into_short_epochs(fake_nvml, monkeypatch):
    # Epochs far shorter than the process-list period: only the first sample reads the
    # process list; every later epoch reports that reading, not NaN (issue 12 item 20).
    monkeypatch.setattr(sampler_module, "_PROCESS_LIST_EVERY_S", 3600.0)
    fake = fake_nvml(h100s(1))
    _, recorder = fit(UtilizationLogger(interval=0.02), epochs=4)
    readings = [v / MIB for v in fake.values(fake.gpus[0].uuid, "proc_mem")]
    assert len(readings) == 1
    first_window = recorder.epochs[0][1]
    assert [s["proc_gpu_mem_mib"] for s in first_window if "proc_gpu_mem_mib" in s] == readings
    for logs, samples in recorder.epochs[1:]:
        assert not [s for s in samples if "proc_gpu_mem_mib" in s]
        assert logs["proc_gpu_mem_mib"] == readings[0]
    # The other figures still come from each window's own samples.
    for logs, samples in recorder.epochs:
        assert logs["gpu0_util"] == pytest.approx(
            sum(s["gpu0_util"] for s in samples) / len(samples)
        )


def test_process_memory_when_pid_does_not_match(fake_nvml):
    # In a container NVML reports host PIDs; without a framework GPU allocator to ask
    # (TensorFlow on CPU here), the figure is NaN, and the key is still there.
    fake_nvml(h100s(1), own_pid=999_999)
    _, recorder = fit(UtilizationLogger(interval=0.02), epochs=1)
    assert math.isnan(recorder.epochs[0][0]["proc_gpu_mem_mib"])


def test_advice_names_utilization_and_pack_size(fake_nvml, caplog):
    gpu = FakeGpu(0, "GPU-aaaaaaaa-0000-0000-0000-000000000000")
    fake = fake_nvml([gpu])
    fake.module.nvmlDeviceGetUtilizationRates = lambda handle: type(
        "U", (), {"gpu": 20, "memory": 5}
    )()
    util_logger = UtilizationLogger(interval=0.02)
    with caplog.at_level(logging.INFO, logger="keras_gpushare.monitor"):
        fit(util_logger, epochs=1)
    assert "GPU 0 busy 20% on average" in util_logger.advice
    assert "ModelPack of about 4 members" in util_logger.advice  # 90% / 20% -> 4, memory ample
    assert any(r.getMessage() == util_logger.advice for r in caplog.records)
    quiet = UtilizationLogger(interval=0.02, advise=False)
    fit(quiet, epochs=1)
    assert quiet.advice is None


def test_explicit_device_that_does_not_exist_fails_before_training(fake_nvml):
    fake = fake_nvml(h100s(2))
    with pytest.raises(ValueError, match=r"NVML index 5 does not exist.*2 GPU"):
        fit(UtilizationLogger(devices=[5]), epochs=1)
    assert not join_monitor_threads()
    assert fake.inits == fake.shutdowns == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"interval": 0}, ValueError, "argument `interval`: got 0"),
        ({"interval": "1"}, TypeError, "argument `interval`: got str"),
        ({"devices": 0}, TypeError, "argument `devices`: got int"),
        ({"devices": []}, ValueError, "argument `devices`: got an empty list"),
        ({"devices": [0, 0]}, ValueError, "names a device twice"),
        ({"devices": [1.5]}, TypeError, "in argument `devices`: got float"),
        ({"every": "batch"}, TypeError, "argument `every`: got str"),
        ({"every": 0}, ValueError, "argument `every`: got 0"),
        ({"advise": 1}, TypeError, "argument `advise`: got int"),
    ],
)
def test_invalid_arguments_are_rejected_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        UtilizationLogger(**kwargs)


def test_every_hook_the_logger_relies_on_fires_under_fit(fake_nvml):
    fake_nvml(h100s(1))
    calls = []

    class Spy(UtilizationLogger):
        def on_train_begin(self, logs=None):
            calls.append("train_begin")
            super().on_train_begin(logs)

        def on_train_batch_end(self, batch, logs=None):
            calls.append("batch_end")
            super().on_train_batch_end(batch, logs)

        def on_epoch_end(self, epoch, logs=None):
            calls.append("epoch_end")
            super().on_epoch_end(epoch, logs)

        def on_train_end(self, logs=None):
            calls.append("train_end")
            super().on_train_end(logs)

    fit(Spy(interval=0.02, every=1), epochs=1, steps=2)
    assert calls == ["train_begin", "batch_end", "batch_end", "epoch_end", "train_end"]


def test_an_epoch_only_logger_keeps_a_packs_batches_per_call():
    """With figures at epoch ends only, the logger shows no batch hook: a ModelPack still
    runs many batches per compiled call (a batch hook makes it one, which on an H200 made a
    pack of 64 members ten times slower); with `every=k` it acts on batches."""
    from keras_gpushare.pack._loop import _batch_calls

    assert _batch_calls.steps_per_call(16, [UtilizationLogger()], []) == 16
    assert _batch_calls.steps_per_call(16, [copy.deepcopy(UtilizationLogger())], []) == 16
    assert _batch_calls.steps_per_call(16, [UtilizationLogger(every=2)], []) == 1
