"""Device selection: CUDA_VISIBLE_DEVICES by index, UUID, prefix or MIG UUID, matched by UUID."""

import math

import pytest
from fake_nvml import FakeGpu, h100s
from monitor_helpers import tiny_data, tiny_model

from keras_gpushare.callbacks import UtilizationLogger
from keras_gpushare.monitor.nvml import NvmlReader


def selected(fake, visible=None, order=None, devices=None):
    reader = NvmlReader(devices, cuda_visible_devices=visible, cuda_device_order=order)
    reader.open()
    try:
        return [d.uuid for d in reader.devices], reader
    finally:
        reader.close()


def scrambled_gpus():
    """NVML lists these in an order that is not PCI bus order (it gives no guarantee)."""
    gpus = h100s(3)
    gpus[0].bus_id, gpus[1].bus_id, gpus[2].bus_id = "0000:30:00.0", "0000:10:00.0", "0000:20:00.0"
    return gpus


def test_unset_means_all_gpus_in_cuda_order(fake_nvml):
    gpus = scrambled_gpus()
    fake = fake_nvml(gpus)
    uuids, reader = selected(fake)
    assert uuids == [gpus[1].uuid, gpus[2].uuid, gpus[0].uuid]
    assert not reader.notes


@pytest.mark.parametrize("visible, want", [("0", [1]), ("2,0", [0, 1]), ("1, 2", [2, 0])])
def test_indices_are_cuda_ordinals_not_nvml_indices(fake_nvml, visible, want):
    gpus = scrambled_gpus()
    fake = fake_nvml(gpus)
    uuids, _ = selected(fake, visible)
    assert uuids == [gpus[i].uuid for i in want]


def test_full_and_abbreviated_uuids(fake_nvml):
    gpus = h100s(3)
    fake = fake_nvml(gpus)
    assert selected(fake, f"{gpus[2].uuid},{gpus[0].uuid}")[0] == [gpus[2].uuid, gpus[0].uuid]
    assert selected(fake, "GPU-00000001")[0] == [gpus[1].uuid]
    # an ambiguous prefix matches nothing: CUDA stops there
    uuids, reader = selected(fake, "0,GPU-0000")
    assert uuids == [gpus[0].uuid] and "matches no GPU" in reader.notes[0]


def test_mig_uuids_select_the_mig_device(fake_nvml):
    gpus = h100s(2)
    child = gpus[1].add_mig("MIG-5c8a1f0e-aaaa-bbbb-cccc-000000000001", gi=1, ci=0)
    fake = fake_nvml(gpus)
    uuids, reader = selected(fake, child.uuid)
    assert uuids == [child.uuid] and reader.devices[0].mig
    legacy = f"MIG-{gpus[1].uuid}/1/0"
    assert selected(fake, legacy)[0] == [child.uuid]

    reader = NvmlReader(cuda_visible_devices=child.uuid)
    reader.open()
    figures = reader.read()
    reader.close()
    assert math.isnan(figures["gpu0_util"])  # NVML has no utilization for MIG devices
    assert figures["gpu0_mem_used_mib"] > 0


@pytest.mark.parametrize("visible", ["", "-1", "7"])
def test_nothing_visible_means_unavailable(fake_nvml, visible):
    fake = fake_nvml(h100s(2))
    uuids, reader = selected(fake, visible)
    assert uuids == [] and "no GPU is visible" in reader.unavailable


def test_invalid_entry_ends_the_list_like_cuda(fake_nvml):
    gpus = h100s(3)
    fake = fake_nvml(gpus)
    uuids, reader = selected(fake, "1,bogus,2")
    assert uuids == [gpus[1].uuid] and "bogus" in reader.notes[0]


def test_mixed_models_without_pci_order_say_so(fake_nvml):
    gpus = [
        FakeGpu(0, "GPU-0a000000-0000-0000-0000-000000000000", name="NVIDIA A100"),
        FakeGpu(1, "GPU-0b000000-0000-0000-0000-000000000000", name="NVIDIA H100"),
    ]
    fake = fake_nvml(gpus)
    _, reader = selected(fake, "0")
    # No CUDA driver on the test machine to ask: never a silent guess.
    assert any("CUDA_DEVICE_ORDER" in note for note in reader.notes)
    uuids, reader = selected(fake, "1", order="PCI_BUS_ID")
    assert uuids == [gpus[1].uuid] and not reader.notes


def test_explicit_devices_override_cuda_visible_devices(fake_nvml):
    gpus = scrambled_gpus()
    fake = fake_nvml(gpus)
    assert selected(fake, "0", devices=[0, 2])[0] == [gpus[0].uuid, gpus[2].uuid]
    assert selected(fake, "0", devices=["GPU-00000002"])[0] == [gpus[2].uuid]
    with pytest.raises(ValueError, match="matches no GPU UUID"):
        selected(fake, devices=["GPU-ffff"])


def test_fit_logs_use_cuda_numbering(fake_nvml, monkeypatch):
    gpus = scrambled_gpus()
    fake = fake_nvml(gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus[2].uuid)
    util_logger = UtilizationLogger(interval=0.02)
    x, y = tiny_data()
    history = tiny_model().fit(x, y, epochs=1, callbacks=[util_logger], verbose=0)
    assert "gpu0_util" in history.history and "gpu1_util" not in history.history
    assert util_logger.monitored_devices[0]["uuid"] == gpus[2].uuid
    assert util_logger.monitored_devices[0]["nvml_index"] == 2
    assert fake.values(gpus[2].uuid, "util") and not fake.values(gpus[0].uuid, "util")


def test_cuda_ordinals_keep_some_devices_under_their_own_keys(fake_nvml):
    gpus = scrambled_gpus()  # CUDA order: gpus[1], gpus[2], gpus[0]
    fake_nvml(gpus)
    reader = NvmlReader(cuda_visible_devices=None, cuda_ordinals={2: 5, 0: 1})
    reader.open()
    assert [(d.key, d.uuid) for d in reader.devices] == [(1, gpus[1].uuid), (5, gpus[0].uuid)]
    assert set(reader.read()) >= {"gpu1_util", "gpu5_util"} and "gpu0_util" not in reader.read()
    reader.close()
    # Through CUDA_VISIBLE_DEVICES: ordinal 1 is its second entry.
    reader = NvmlReader(cuda_visible_devices=f"0,{gpus[0].uuid}", cuda_ordinals={1: 0})
    reader.open()
    assert [(d.key, d.uuid) for d in reader.devices] == [(0, gpus[0].uuid)]
    reader.close()
    # An ordinal CUDA does not show: a note, and nothing to monitor.
    reader = NvmlReader(cuda_visible_devices="0", cuda_ordinals={1: 1})
    reader.open()
    assert reader.devices == [] and "GPU:1 is CUDA device 1, but only 1 GPU(s)" in reader.notes[0]
    assert reader.unavailable == "no GPU of the distribution strategy's replicas is visible to NVML"
    # Explicit devices win.
    reader = NvmlReader([0], cuda_visible_devices=None, cuda_ordinals={1: 3})
    reader.open()
    assert [(d.key, d.uuid) for d in reader.devices] == [(0, gpus[0].uuid)]
    reader.close()
