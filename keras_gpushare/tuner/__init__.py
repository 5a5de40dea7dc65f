"""Parallel hyperparameter search for KerasTuner: `ParallelTuner` and `ParallelOracle`."""

from keras_gpushare.tuner.oracle import ParallelOracle
from keras_gpushare.tuner.tuner import ParallelTuner

__all__ = ["ParallelOracle", "ParallelTuner"]
