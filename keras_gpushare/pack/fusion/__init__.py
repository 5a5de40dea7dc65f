"""The fused engine: N same-architecture models as one model with stacked weights."""

from keras_gpushare.pack.fusion import (
    layers_attention,
    layers_conv,
    layers_core,
    layers_norm,
    layers_recurrent,
    layers_wrappers,
)
from keras_gpushare.pack.fusion._optimizer_rules import OptimizerRule, register_optimizer_rule
from keras_gpushare.pack.fusion.base import FusedLayer
from keras_gpushare.pack.fusion.layers_core import FusedPerSample
from keras_gpushare.pack.fusion.model import FusedModel, build_fused_model
from keras_gpushare.pack.fusion.optimizer import VectorizedOptimizer
from keras_gpushare.pack.fusion.registry import register_fused_layer
from keras_gpushare.pack.fusion.report import FusionReport, fusion_report

__all__ = [
    "layers_attention",
    "FusedLayer",
    "FusedModel",
    "FusedPerSample",
    "FusionReport",
    "OptimizerRule",
    "build_fused_model",
    "fusion_report",
    "layers_conv",
    "layers_core",
    "layers_norm",
    "layers_recurrent",
    "layers_wrappers",
    "register_fused_layer",
    "register_optimizer_rule",
    "VectorizedOptimizer",
]
