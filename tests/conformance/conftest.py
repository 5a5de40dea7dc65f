"""Fixtures of the conformance suite: one runner per session, a clean dtype policy."""

import keras
import pytest
from conformance_harness import Runner


@pytest.fixture(scope="session")
def runner(tmp_path_factory):
    return Runner(tmp_path_factory.mktemp("conformance"))


@pytest.fixture(autouse=True)
def float32_policy():
    """Every test starts and ends under the float32 policy, whatever a case did."""
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")
