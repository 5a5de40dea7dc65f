"""One stateful Keras metric for N members at once, its state stacked on a member axis."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack.fusion.base import host_zeros

# Metrics whose state starts at zero and whose update and result map over a member axis
# exactly (`ops.vectorized_map` of their stateless methods): the confusion-matrix family,
# the F-scores, R2 and the root mean squared error; the IoU family except on torch, whose
# `vmap` cannot map the scatter of their confusion matrix.
_IOU = (
    keras.metrics.IoU,
    keras.metrics.MeanIoU,
    keras.metrics.BinaryIoU,
    keras.metrics.OneHotIoU,
    keras.metrics.OneHotMeanIoU,
)
STACKABLE = (
    keras.metrics.AUC,
    keras.metrics.Precision,
    keras.metrics.Recall,
    keras.metrics.PrecisionAtRecall,
    keras.metrics.RecallAtPrecision,
    keras.metrics.SensitivityAtSpecificity,
    keras.metrics.SpecificityAtSensitivity,
    keras.metrics.TruePositives,
    keras.metrics.FalsePositives,
    keras.metrics.TrueNegatives,
    keras.metrics.FalseNegatives,
    keras.metrics.FBetaScore,
    keras.metrics.F1Score,
    keras.metrics.R2Score,
    keras.metrics.RootMeanSquaredError,
    *(() if BACKEND.name == "torch" else _IOU),
)


class StackedMetric(keras.metrics.Metric):
    """`template`'s metric for N members: each variable gains a leading member axis.

    One update on the stacked predictions `(N, B, ...)` updates every member's state (the
    template's own update, mapped over the members), instead of N metric updates in the
    step; `result()` is the `(N,)` vector of the members' results. The template's own
    variables are never touched.

    Args:
        template: one member's metric (every member's is alike); one of `STACKABLE`.
        n_members: the number of members.
    """

    def __init__(self, template: keras.metrics.Metric, n_members: int, **kwargs: Any) -> None:
        super().__init__(name=f"member_{template.name}", **kwargs)
        # Not tracked: the template's own variables are no part of this metric's state.
        object.__setattr__(self, "template", template)
        self.n_members = n_members
        self.stacked = [
            self.add_variable(
                (n_members, *v.shape), initializer=host_zeros, dtype=v.dtype, name=v.name
            )
            for v in template.variables
        ]

    def update_state(
        self, y_true: Any, y_pred: Any, sample_weight: Any = None, per_member: bool = False
    ) -> None:
        """`y_pred` stacked `(N, B, ...)`; `y_true` and `sample_weight` one member's, or
        with `per_member` every member's, stacked too."""

        def one(args: Any) -> Any:
            values, pred, *targets = args
            label, weight = targets if per_member else (y_true, sample_weight)
            return self.template.stateless_update_state(
                list(values), label, pred, sample_weight=weight
            )

        values = [ops.convert_to_tensor(v) for v in self.stacked]
        if not per_member:
            new = ops.vectorized_map(one, (values, y_pred))
        elif sample_weight is None:
            new = ops.vectorized_map(lambda args: one((*args, None)), (values, y_pred, y_true))
        else:
            new = ops.vectorized_map(one, (values, y_pred, y_true, sample_weight))
        for variable, value in zip(self.stacked, new):
            variable.assign(value)

    def result(self) -> Any:
        values = [ops.convert_to_tensor(v) for v in self.stacked]
        return ops.vectorized_map(lambda v: self.template.stateless_result(list(v)), values)

    def reset_member(self, j: int) -> None:
        """Zeroes member j's state, leaving the others'."""
        for variable in self.stacked:
            values = np.array(ops.convert_to_numpy(variable))
            values[j] = 0
            variable.assign(values)


def ready(metric: keras.metrics.Metric, pred_shape: Any) -> None:
    """Makes the state of a metric that makes it on its first update (`F1Score`,
    `R2Score`), for predictions of `pred_shape`: one update on zeros, then a reset."""
    if _upstream.metric_built(metric):
        return
    zeros = np.zeros((1, *tuple(pred_shape)[1:]), dtype="float32")
    metric.update_state(zeros, zeros)
    metric.reset_state()


def stacks(metric: keras.metrics.Metric) -> bool:
    """Whether `metric` can be one of a `StackedMetric`'s members: one of `STACKABLE`
    exactly (not a subclass, whose update may differ), its state made, with a
    single-number result."""
    return (
        type(metric) in STACKABLE
        and _upstream.metric_built(metric)
        and len(ops.shape(metric.result())) == 0
    )


def why_not(metric: keras.metrics.Metric) -> str:
    """Why `metric` (not stacked) is computed member by member, in a few words."""
    if type(metric) not in STACKABLE:
        if isinstance(metric, _IOU) and BACKEND.name == "torch":
            return "torch cannot vectorize its update"
        return f"{type(metric).__name__} is not one of the metrics computed stacked"
    if not _upstream.metric_built(metric):
        return "its state could not be made before the first step"
    return "its result is not one number"
