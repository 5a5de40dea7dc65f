"""The fused engine's stacked metrics: N members' running means and metrics at once.

`StackedMean` keeps N running means (each member's loss, a mean metric alike for every
member) in two stacked variables; `StackedMetric` one stateful Keras metric for N members,
its state stacked on a member axis. The column helpers say which of the members' compiled
metrics line up to be computed so, and under which names they are logged.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack.engines.base import StackedRatio, host_mean
from keras_gpushare.pack.fusion.base import host_constant, host_zeros

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

# A user's metric classes, by member 0's metric of a column: the values its `reset_state`
# leaves where `probe` found its update, mapped over the members, equal to each member's
# own; else why it is computed member by member.
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StackedMetric(keras.metrics.Metric):
    """`template`'s metric for N members: each variable gains a leading member axis.

    One update on the stacked predictions `(N, B, ...)` updates every member's state (the
    template's own update, mapped over the members), instead of N metric updates in the
    step; `result()` is the `(N,)` vector of the members' results. The template's own
    variables are never touched.

    Args:
        template: one member's metric (every member's is alike): one of `STACKABLE`, or a
            user's that `probe` found to map over the members.
        n_members: the number of members.
        initial: the values the template's `reset_state` leaves in its variables (a user's
            metric may reset to other values than zeros); None for zeros.
    """

    def __init__(
        self,
        template: keras.metrics.Metric,
        n_members: int,
        initial: list | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name=f"member_{template.name}", **kwargs)
        # Not tracked: the template's own variables are no part of this metric's state.
        object.__setattr__(self, "template", template)
        self.n_members = n_members
        self.initial = initial
        self.stacked = [
            self.add_variable(
                (n_members, *v.shape),
                initializer=host_zeros
                if initial is None
                else host_constant([initial[k]] * n_members),
                dtype=v.dtype,
                name=v.name,
            )
            for k, v in enumerate(template.variables)
        ]

    def reset_state(self) -> None:
        if self.initial is None:
            super().reset_state()
            return
        for variable, value in zip(self.stacked, self.initial):
            variable.assign(np.broadcast_to(value, variable.shape))

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
        """Restarts member j's state, leaving the others'."""
        for k, variable in enumerate(self.stacked):
            values = np.array(ops.convert_to_numpy(variable))
            values[j] = 0 if self.initial is None else self.initial[k]
            variable.assign(values)


class StackedMean(keras.metrics.Metric):
    """N running means at once, one per member, in two stacked variables.

    The fused engine keeps every member's loss and shared metrics this way: a few vector
    operations a step instead of N small metric updates.
    """

    def __init__(self, n_members: int, name: str = "stacked_mean", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.n_members = n_members
        self.total = self.add_variable((n_members,), initializer=host_zeros, name="total")
        self.count = self.add_variable((n_members,), initializer=host_zeros, name="count")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        values = ops.cast(values, self.dtype)
        weight = ops.ones_like(values) if sample_weight is None else sample_weight
        weight = ops.cast(weight, self.dtype)
        self.total.assign_add(values * weight)
        self.count.assign_add(weight)

    def add(self, totals: Any, counts: Any) -> None:
        """Adds `(N,)` sums and counts (each member's weighted sum and its weights')."""
        self.total.assign_add(ops.cast(totals, self.dtype))
        self.count.assign_add(ops.cast(counts, self.dtype))

    def reset_member(self, j: int) -> None:
        """Zeroes member j's running mean, leaving the others'."""
        for variable in (self.total, self.count):
            values = np.array(ops.convert_to_numpy(variable))
            values[j] = 0.0
            variable.assign(values)

    def result(self) -> Any:
        count = ops.convert_to_tensor(self.count)
        total = ops.convert_to_tensor(self.total)
        host = BACKEND.host_values(count, total)
        if host is not None:  # read outside the step: the same figures, no program compiled
            count, total = host
            return host_mean(total, count)
        mean = total / ops.maximum(count, 1e-12)
        return ops.where(count > 0, mean, float("nan"))

    def ratio(self) -> StackedRatio:
        """The running sums, undivided: what the step's logs carry (see `StackedRatio`)."""
        return StackedRatio(ops.convert_to_tensor(self.total), ops.convert_to_tensor(self.count))

    def get_config(self) -> dict:
        return {"n_members": self.n_members, "name": self.name}


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
    exactly (not a subclass, whose update may differ) or a user's that `probe` found to
    map, its state made, with a single-number result."""
    return (
        (type(metric) in STACKABLE or isinstance(_PROBED.get(metric), list))
        and _upstream.metric_built(metric)
        and len(ops.shape(metric.result())) == 0
    )


def initial_values(metric: keras.metrics.Metric) -> list | None:
    """The reset state of a user's metric that `probe` found to map (None: zeros)."""
    found = _PROBED.get(metric)
    return found if isinstance(found, list) else None


# The batch a user's metric is tried on (`probe`).
_PROBE_BATCH = 16


def probe(column: list, label: Any, output_shape: tuple, per_member: bool, weighted: bool) -> None:
    """Decides whether a column of a user's metrics (one per member, of one class and
    configuration) is computed stacked, by trying it: each member's metric, reset, updated
    on random labels and predictions alone, against the first one's update mapped over the
    members from its reset state (`StackedMetric`); stacked when every member's result is
    its own.

    Not tried, so computed member by member: Keras's own metrics (`STACKABLE` says which
    map); a class that does not define `get_config` (its members' metrics could be
    configured differently where their configurations read alike); a metric whose state
    starts other than its `reset_state` leaves it (Keras resets it before some first epochs
    and not others: on TensorFlow not before the first). The members' metrics are left as
    they were.

    Args:
        column: the members' metrics of one name, alike.
        label: this output's labels, for their shape and dtype (tried: labels of 0 and 1,
            or integers below the output's width); with `per_member` every member is tried
            on labels of its own.
        output_shape: one member's output, batch axis first.
        per_member: whether the labels are given one per member.
        weighted: a column of `weighted_metrics`, tried with random sample weights too.
    """
    first = column[0]
    if first in _PROBED or _upstream.is_keras_builtin(type(first)):
        return
    if type(first).get_config is keras.metrics.Metric.get_config:
        _PROBED[first] = (
            f"{type(first).__name__} defines no `get_config`, so its members' metrics cannot "
            "be told alike"
        )
        return
    kept = [[np.array(ops.convert_to_numpy(v)) for v in m.variables] for m in column]
    try:
        _PROBED[first] = _try_stacked(column, label, output_shape, per_member, weighted)
    except Exception as e:  # a user's update that cannot be mapped: member by member
        lines = str(e).strip().splitlines()
        error = type(e).__name__ + (f": {lines[0][:100]}" if lines else "")
        _PROBED[first] = f"its update could not be mapped over the members ({error})"
    finally:
        for metric, values in zip(column, kept):
            for variable, value in zip(metric.variables, values):
                variable.assign(value)


def _try_stacked(
    column: list, label: Any, output_shape: tuple, per_member: bool, weighted: bool
) -> list | str:
    """`probe`'s trial: the reset state to stack from, or why not."""
    first, n, rng = column[0], len(column), np.random.default_rng(0)
    # The class's own start and reset, on a new metric (the members' may have been used).
    new = type(first).from_config(first.get_config())
    fresh = [np.array(ops.convert_to_numpy(v)) for v in new.variables]
    new.reset_state()
    initial = [np.array(ops.convert_to_numpy(v)) for v in new.variables]
    if any(not np.array_equal(a, b) for a, b in zip(fresh, initial)):
        return "its state starts other than its `reset_state` leaves it"
    predictions = rng.random((n, _PROBE_BATCH, *tuple(output_shape)[1:])).astype("float32")
    dtype = keras.backend.standardize_dtype(label.dtype)
    top = max(int(output_shape[-1] or 1), 2) if "int" in dtype else 2
    labels = rng.integers(0, top, size=(n, _PROBE_BATCH, *tuple(label.shape)[1:]))
    labels = labels.astype(dtype)
    weights = rng.random((n, _PROBE_BATCH)).astype("float32") if weighted else None
    own = []
    for j, metric in enumerate(column):
        metric.reset_state()
        j_label = labels[j] if per_member else labels[0]
        j_weight = None if weights is None else weights[j] if per_member else weights[0]
        metric.update_state(j_label, predictions[j], sample_weight=j_weight)
        own.append(np.asarray(ops.convert_to_numpy(metric.result()), dtype="float64"))
    mapped = StackedMetric(first, n, initial=initial)
    mapped.update_state(
        ops.convert_to_tensor(labels if per_member else labels[0]),
        ops.convert_to_tensor(predictions),
        None if weights is None else ops.convert_to_tensor(weights if per_member else weights[0]),
        per_member=per_member,
    )
    results = np.asarray(ops.convert_to_numpy(mapped.result()), dtype="float64")
    if results.shape != (n,) or not np.allclose(
        results, np.stack(own), rtol=1e-5, atol=1e-6, equal_nan=True
    ):
        return "its update mapped over the members did not give each member's own"
    return initial


def why_not(metric: keras.metrics.Metric) -> str:
    """Why `metric` (not stacked) is computed member by member, in a few words."""
    if isinstance(_PROBED.get(metric), str):
        return _PROBED[metric]
    if type(metric) not in STACKABLE and not isinstance(_PROBED.get(metric), list):
        if isinstance(metric, _IOU) and BACKEND.name == "torch":
            return "torch cannot vectorize its update"
        return f"{type(metric).__name__} is not one of the metrics computed stacked"
    if not _upstream.metric_built(metric):
        return "its state could not be made before the first step"
    return "its result is not one number"


def undivided(state: StackedMean | StackedMetric) -> Any:
    """A shared metric's figure for the step's logs: a running mean undivided."""
    return state.ratio() if isinstance(state, StackedMean) else state.result()


def figure_name(names: dict[str, int], output: str | None, metric: str, weighted: bool) -> str:
    """A compiled metric's log name as Keras's `CompileMetrics.result` gives it: the output's
    name first; a weighted metric whose name is taken prefixed `weighted_`; a name taken
    again numbered. `names` counts the names given so far."""
    name = f"{output}_{metric}" if output else metric
    if name not in names:
        names[name] = 1
        return name
    if weighted:
        name = f"{output}_weighted_{metric}" if output else f"weighted_{metric}"
        if name not in names:
            names[name] = 1
            return name
    index = names[name]
    names[name] += 1
    return f"{name}_{index}"


def alike_columns(parts: list) -> list | None:
    """`(output, output name, member 0's metric, the members' metrics, stacked)` for each
    metric of the members' `metric_parts` (one list per member), when every member has
    metrics of the same names output by output; else None. `stacked` when the column's
    metrics are alike (class and configuration), each a mean of a function or a
    `StackedMetric` kind: computed once for all members; else member by member."""
    if any(len(p) != len(parts[0]) for p in parts):
        return None
    found = []
    for output, first in enumerate(parts[0]):
        alike = [p[output] for p in parts]
        if first is None:
            if any(part is not None for part in alike):
                return None
            continue
        name, metrics = first
        lists = [p[1] for p in alike if p is not None and p[0] == name]
        if len(lists) != len(alike) or any(len(m) != len(metrics) for m in lists):
            return None
        for k, metric in enumerate(metrics):
            column = [m[k] for m in lists]
            if any(m.name != metric.name for m in column):
                return None
            stacked = (
                isinstance(metric, keras.metrics.MeanMetricWrapper) or stacks(metric)
            ) and metrics_alike(column)
            found.append((output, name, metric, column, stacked))
    return found


def metrics_alike(column: list) -> bool:
    """Whether the members' metrics of a column are of one class and configuration."""
    first = column[0]
    return all(type(m) is type(first) and m.get_config() == first.get_config() for m in column)


def own_reason(column: list) -> str:
    """Why a column of metrics (one per member, of one name) is computed member by member."""
    if metrics_alike(column):
        return why_not(column[0])
    return "the members' metrics of this name differ"


def weighted_sums(values: Any, weight: Any, per_member: bool = False) -> tuple[Any, Any]:
    """Each member's weighted sum of `values` `(N, B, ...)` and the sum of its weights, as
    Keras's `Mean.update_state` adds them (`reduce_to_samplewise_values`); `weight` is one
    member's, or with `per_member` every member's, stacked `(N, B, ...)`."""
    weight = ops.cast(weight, "float32")
    if not per_member:
        weight = ops.broadcast_to(ops.expand_dims(weight, 0), (values.shape[0], *weight.shape))
    rank = len(weight.shape)
    if len(values.shape) > rank:
        values = ops.mean(values, axis=tuple(range(rank, len(values.shape))))
    weight = ops.broadcast_to(weight, ops.shape(values))
    values = values * weight
    if rank > 2:
        weight = ops.mean(weight, axis=tuple(range(2, rank)))
    if len(values.shape) > 2:
        values = ops.mean(values, axis=tuple(range(2, len(values.shape))))
    return ops.sum(values, axis=1), ops.sum(weight, axis=1)
