"""Data shared by the ModelPack tests."""

import numpy as np
import pytest


@pytest.fixture
def binary_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 10)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y
