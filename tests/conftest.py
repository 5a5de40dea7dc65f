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
