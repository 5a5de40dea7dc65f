"""The `fused` engine's loss, metrics and member synchronisation, backend-neutral.

A fused pack is one Keras model: the `FusedModel` (stacked weights, member axis first) and a
`VectorizedOptimizer`, driven by Keras's own `train_step` on every backend. The pack's
`compute_loss` sums the members' own compiled losses, so member `i`'s slice of every stacked
weight gets exactly member `i`'s gradient. A member that is not active (frozen, stopped) gets
a non-finite gradient on purpose: the vectorized optimizer never applies one, so that
member's weights, optimizer slots and step count stay as they are, with no extra state that
a stateless (JAX) step would have to carry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
from keras import ops, tree
from keras.src.losses.loss import scale_loss_for_distribution, unscale_loss_for_distribution
from keras.src.losses.losses import LossFunctionWrapper

from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack import replicas
from keras_gpushare.pack.members import ACTIVE, FROZEN_NAN

if TYPE_CHECKING:
    from keras_gpushare.pack.model import ModelPack


class StackedMean(keras.metrics.Metric):
    """N running means at once, one per member, in two stacked variables.

    The fused engine keeps every member's loss and shared metrics this way: a few vector
    operations a step instead of N small metric updates.
    """

    def __init__(self, n_members: int, name: str = "stacked_mean", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.n_members = n_members
        self.total = self.add_variable((n_members,), initializer="zeros", name="total")
        self.count = self.add_variable((n_members,), initializer="zeros", name="count")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        values = ops.cast(values, self.dtype)
        weight = ops.ones_like(values) if sample_weight is None else sample_weight
        weight = ops.cast(weight, self.dtype)
        self.total.assign_add(values * weight)
        self.count.assign_add(weight)

    def result(self) -> Any:
        count = ops.convert_to_tensor(self.count)
        mean = ops.convert_to_tensor(self.total) / ops.maximum(count, 1e-12)
        return ops.where(count > 0, mean, float("nan"))

    def get_config(self) -> dict:
        return {"n_members": self.n_members, "name": self.name}


def split_outputs(outputs: Any, n: int) -> list:
    """Member `i`'s outputs (slice `i` of every stacked leaf) for each member."""
    return [tree.map_structure(lambda t, i=i: t[i], outputs) for i in range(n)]


def _stacked(y_pred: Any) -> Any:
    """The stacked single output `(N, B, ...)` from a per-member list or the stacked output.

    In training the pack passes the fused model's stacked output through untouched (a
    tensor, never a list): N slices stacked back together would cost N full-size gradient
    terms in the backward pass.
    """
    if isinstance(y_pred, list):
        return ops.stack([tree.flatten(p)[0] for p in y_pred])
    return tree.flatten(y_pred)[0]


def _batch_size(x: Any) -> Any:
    return ops.shape(tree.flatten(x)[0])[0]


def shared_loss(pack: ModelPack) -> keras.losses.Loss | None:
    """One loss object computing every member's loss at once, or None.

    That holds when every member has one output and the same loss (same configuration, the
    default reduction) and no loss weights: then one call on the stacked predictions gives
    the N losses, instead of N small loss computations in the step.
    """
    args = pack._member_compile_args
    if args is None or args["loss_weights"] is not None:
        return None
    if any(data_lib.output_count(m) != 1 for m in pack._members):
        return None
    specs = [keras.saving.serialize_keras_object(spec) for spec in args["loss"]]
    if any(spec != specs[0] for spec in specs):
        return None
    loss = keras.losses.get(args["loss"][0])
    if not isinstance(loss, keras.losses.Loss):
        loss = LossFunctionWrapper(loss)
    if getattr(loss, "reduction", None) != "sum_over_batch_size":
        return None
    return loss


def _stacked_losses(loss: keras.losses.Loss, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """Every member's loss, shape (N,), from one call on the stacked predictions."""
    stacked = _stacked(y_pred)
    y = tree.flatten(y)[0]
    y = ops.broadcast_to(ops.expand_dims(y, 0), (stacked.shape[0], *ops.shape(y)))
    values = ops.cast(loss.call(y, stacked), "float32")
    if sample_weight is not None:
        weight = ops.cast(tree.flatten(sample_weight)[0], "float32")
        while len(weight.shape) + 1 < len(values.shape):
            weight = ops.expand_dims(weight, -1)
        while len(weight.shape) + 1 > len(values.shape):
            weight = ops.squeeze(weight, -1)
        values = values * weight
    axes = tuple(range(1, len(values.shape)))
    return ops.sum(values, axis=axes) / ops.cast(ops.prod(ops.shape(values)[1:]), "float32")


def _member_losses(pack: ModelPack, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """Every member's loss on this replica's batch, shape (N,), not scaled for replicas."""
    members = pack._members
    n = len(members)
    per_member = data_lib.labels_per_member(y, n)
    loss = None if per_member else pack._shared_loss
    if loss is not None and (sample_weight is None or not tree.is_nested(sample_weight)):
        return _stacked_losses(loss, y, y_pred, sample_weight)
    losses = []
    for i, (member, (yi, swi)) in enumerate(
        zip(members, data_lib.member_targets(y, sample_weight, n))
    ):
        value = member._compile_loss(yi, y_pred[i], swi)
        losses.append(ops.cast(unscale_loss_for_distribution(value), "float32"))
    return ops.stack(losses)


def compute_loss(
    pack: ModelPack, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool
) -> Any:
    """The sum of the active members' losses (plus the stacked weights' regularization).

    Every member's loss goes into the pack's stacked loss state. In training, a member that
    is not active gets a NaN factor on its loss, hence a non-finite gradient that the
    vectorized optimizer never applies, and a member whose loss is not finite (on any
    replica, under a `tf.distribute` strategy) is frozen. Like Keras's own losses, the total
    is divided by the number of replicas, so all-reduced gradients are the global batch's.
    """
    losses = _member_losses(pack, y, y_pred, sample_weight)
    batch = ops.cast(_batch_size(x), "float32")
    if not training:
        pack._loss_state.update_state(losses, ops.ones_like(losses) * batch)
        total = ops.sum(losses)
    else:
        status = ops.convert_to_tensor(pack._status)
        active = ops.equal(status, ACTIVE)
        finite = ops.isfinite(losses)
        ok = ops.logical_and(active, finite)
        pack._loss_state.update_state(
            ops.where(ok, losses, 0.0), ops.where(ok, batch, 0.0) * ops.ones_like(losses)
        )
        total = ops.sum(losses * ops.where(active, 1.0, float("nan")))
        if pack._on_nan == "freeze":
            not_finite = replicas.any_replica(ops.logical_not(finite))
            frozen = ops.logical_and(active, not_finite)
            pack._status.assign(ops.where(frozen, FROZEN_NAN, status))
    regularization = pack.losses
    if regularization:
        total = total + ops.cast(ops.sum(ops.stack(regularization)), "float32")
    return scale_loss_for_distribution(total)


def compute_metrics(pack: ModelPack, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> dict:
    """Updates every member's metrics and returns the pack's logs.

    Unweighted mean-of-a-function metrics (accuracy, MAE, ...) that every member has alike
    are computed for all members at once on the stacked predictions into stacked state
    (they ignore sample weights, as Keras's `metrics=` do); other metrics member by member.
    """
    members = pack._members
    n = len(members)
    targets = data_lib.member_targets(y, sample_weight, n)
    for i, (member, (yi, _)) in enumerate(zip(members, targets)):
        if member._compile_metrics is not None and not member._compile_metrics.built:
            member._compile_metrics.build(yi, y_pred[i])
    shared = None if data_lib.labels_per_member(y, n) else _shared_metrics(members)
    if shared is not None:
        _update_shared_metrics(pack, shared, y, y_pred)
    else:
        for i, (member, (yi, swi)) in enumerate(zip(members, targets)):
            if member._compile_metrics is not None:
                member._compile_metrics.update_state(yi, y_pred[i], swi)
    return fused_logs(pack, shared is not None)


def fused_logs(pack: ModelPack, shared: bool) -> dict:
    """`loss`, `m{i}_loss` and `m{i}_<metric>` from the stacked (or members') state.

    A member that ran no step since the last reset logs NaN and is left out of `loss`.
    """
    losses = pack._loss_state.result()
    ran = ops.greater(ops.convert_to_tensor(pack._loss_state.count), 0)
    nan = ops.convert_to_tensor(float("nan"))
    count = ops.sum(ops.cast(ran, "float32"))
    total = ops.sum(ops.where(ran, losses, 0.0))
    logs = {"loss": ops.where(count > 0, total / ops.maximum(count, 1.0), nan)}
    metric_results = [
        {name: state.result() for name, state in pack._metric_states.items()} if shared else None
    ]
    for i, member in enumerate(pack._members):
        logs[f"m{i}_loss"] = losses[i]
        if shared:
            items = {name: value[i] for name, value in metric_results[0].items()}
        elif member._compile_metrics is not None:
            items = member._compile_metrics.result()
        else:
            items = {}
        for name, value in items.items():
            logs[f"m{i}_{name}"] = ops.where(ran[i], ops.cast(value, "float32"), nan)
    return logs


def _shared_metrics(members: list) -> list | None:
    """Per metric, the N members' metric objects, when all are alike mean-of-a-function ones."""
    compiled = [m._compile_metrics for m in members]
    if any(c is None for c in compiled):
        return None if any(c is not None for c in compiled) else []
    per_member = [list(c.metrics) for c in compiled]
    if any(any(w is not None for w in c._flat_weighted_metrics) for c in compiled) or any(
        len(m) != len(per_member[0]) for m in per_member
    ):
        return None
    shared = []
    for k, first in enumerate(per_member[0]):
        column = [m[k] for m in per_member]
        if not isinstance(first, keras.metrics.MeanMetricWrapper) or any(
            type(m) is not type(first) or m.get_config() != first.get_config() for m in column
        ):
            return None
        shared.append(column)
    return shared


def _update_shared_metrics(pack: ModelPack, shared: list, y: Any, y_pred: Any) -> None:
    stacked = _stacked(y_pred)
    y = tree.flatten(y)[0]
    y = ops.broadcast_to(ops.expand_dims(y, 0), (stacked.shape[0], *ops.shape(y)))
    for column in shared:
        first = column[0]
        values = ops.cast(first._fn(y, stacked, **first._fn_kwargs), "float32")
        axes = tuple(range(1, len(values.shape)))
        count = ops.cast(ops.prod(ops.shape(values)[1:]), "float32")
        state = _metric_state(pack, first.name)
        state.update_state(ops.sum(values, axis=axes) / count, ops.ones((len(column),)) * count)


def _metric_state(pack: ModelPack, name: str) -> StackedMean:
    """The stacked state of the shared metric `name`, made on first use."""
    state = pack._metric_states.get(name)
    if state is None:
        state = StackedMean(len(pack._members), name=f"member_{name}")
        pack._metric_states[name] = state
    return state


def build_metric_states(pack: ModelPack, y: Any) -> None:
    """Makes the shared metrics' stacked state before the first step.

    Without a strategy the first trace of the step may make it; under a `tf.distribute`
    strategy variables must exist before the step runs on the replicas.
    """
    if data_lib.labels_per_member(y, len(pack._members)):
        return
    for column in _shared_metrics(pack._members) or []:
        _metric_state(pack, column[0].name)


def sync_members(pack: ModelPack) -> None:
    """Writes the stacked weights and optimizer state back into the member models."""
    members = list(pack._members)
    pack._fused.write_to_members(members)
    optimizer = getattr(pack, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return
    for member in members:
        if member.optimizer is not None and not member.optimizer.built:
            member.optimizer.build(member.trainable_variables)
    optimizer.write_state_to(
        [m.optimizer for m in members], pack._fused.member_variable_map(members)
    )


def set_member_weights(pack: ModelPack, index: int, weights: list) -> None:
    """Puts `weights` (as `member.get_weights()` orders them) into member `index`'s slices."""
    member = pack._members[index]
    member.set_weights(weights)
    for fused_variable, member_variables in pack._fused.member_variable_map(pack._members):
        value = ops.convert_to_numpy(fused_variable).copy()
        value[index] = ops.convert_to_numpy(member_variables[index])
        fused_variable.assign(value)


def member_weights(pack: ModelPack, index: int) -> list:
    """Member `index`'s weights, ordered as `member.get_weights()` orders them."""
    member = pack._members[index]
    by_id = {}
    for fused_variable, member_variables in pack._fused.member_variable_map(pack._members):
        by_id[id(member_variables[index])] = fused_variable
    return [ops.convert_to_numpy(by_id[id(v)])[index] for v in member.weights]
