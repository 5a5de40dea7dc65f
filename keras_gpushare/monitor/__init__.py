"""GPU utilization monitoring: `UtilizationLogger` and the NVML access behind it.

`UtilizationLogger` is loaded on first use, so `keras_gpushare.monitor.nvml` (used by the
`keras-gpushare monitor` command) does not import Keras or a backend.
"""

__all__ = ["UtilizationLogger"]


def __getattr__(name):
    if name == "UtilizationLogger":
        from keras_gpushare.monitor.callback import UtilizationLogger

        return UtilizationLogger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
