"""Fixtures of the monitor tests: a fake `pynvml` in `sys.modules`, tiny models, threads."""

import sys

import pytest
from fake_nvml import FakeNvml, h100s


@pytest.fixture
def fake_nvml(monkeypatch):
    """Returns a factory: `fake_nvml(gpus=None, **options)` installs and returns a FakeNvml."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)

    def install(gpus=None, **options):
        fake = FakeNvml(h100s(1) if gpus is None else gpus, **options)
        monkeypatch.setitem(sys.modules, "pynvml", fake.module)
        return fake

    return install
