"""Fixtures of the conformance suite: one runner per module, a clean dtype policy."""

import keras
import pytest
from conformance_harness import Runner


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """Memoizes each (case, engine) run for every aspect of the module, then frees them."""
    return Runner(tmp_path_factory.mktemp("conformance"))


@pytest.fixture(autouse=True)
def float32_policy():
    """Every test starts and ends under the float32 policy, whatever a case did."""
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")
