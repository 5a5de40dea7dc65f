"""Shared test setup.

Keras runs on TensorFlow unless the test run sets `KERAS_BACKEND`. On TensorFlow the one
physical CPU is split into four logical CPUs before anything else touches TensorFlow, so
placement tests can put stages on `/CPU:0` ... `/CPU:3` in the same session as the rest.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's LLVM optimizations take about a third of the JAX suite's time, in compiling. The tests
# compare programs compiled with the same flags, so they run without them (users keep XLA's
# defaults). Fast math stays off either way.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

LOGICAL_CPUS = 4

if os.environ["KERAS_BACKEND"] == "tensorflow":
    import tensorflow as tf

    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(LOGICAL_CPUS)]
    )


# The files that take longest (the TensorFlow run's `--durations`, 2026-12-07: 130-930 s of
# CPU time each on the 2-core CI machine under load), slowest first. `make test` hands files
# to its two workers in collection order (`--no-loadscope-reorder`): starting with these
# leaves the many short files to even out the end, where a slow file dealt last would run
# alone.
SLOW_FILES_FIRST = (
    "tests/conformance/test_conformance_matrix.py",
    "tests/pack/test_stacked_step.py",
    "tests/pack/fusion/test_fused_padding.py",
    "tests/tuner/conformance/test_conformance_behaviour.py",
    "tests/pack/test_pack_slots.py",
    "tests/distribute/test_mirrored_pack.py",
    "tests/tuner/conformance/test_conformance_results.py",
    "tests/tuner/test_tuner_devices.py",
    "tests/tuner/test_tuner_pack.py",
    "tests/autopack/test_autopack_cli.py",
    "tests/pack/test_member_copy_state.py",
    "tests/tuner/test_tuner_paths.py",
    "tests/tuner/test_tuner_slots.py",
    "tests/test_docstring_examples.py",
    "tests/distribute/test_multi_worker_pack.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    root = str(config.rootpath)

    def key(item):
        path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        return rank.get(path, len(rank))

    items.sort(key=key)
