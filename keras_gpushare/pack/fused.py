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

from keras import ops, tree

from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack.logs import pack_logs
from keras_gpushare.pack.members import ACTIVE, FROZEN_NAN

if TYPE_CHECKING:
    from keras_gpushare.pack.model import ModelPack


def split_outputs(outputs: Any, n: int) -> list:
    """Member `i`'s outputs (slice `i` of every stacked leaf) for each member."""
    return [tree.map_structure(lambda t, i=i: t[i], outputs) for i in range(n)]


def _batch_size(x: Any) -> Any:
    return ops.shape(tree.flatten(x)[0])[0]


def compute_loss(
    pack: ModelPack, x: Any, y: Any, y_pred: list, sample_weight: Any, training: bool
) -> Any:
    """The sum of the active members' losses (plus the stacked weights' regularization)."""
    members = pack._members
    n = len(members)
    per_member = data_lib.labels_per_member(y, n)
    sw_per_member = per_member and isinstance(sample_weight, (list, tuple))
    status = ops.convert_to_tensor(pack._status)
    batch = ops.cast(_batch_size(x), "float32")
    nan = ops.convert_to_tensor(float("nan"))
    terms, finite = [], []
    for i, member in enumerate(members):
        yi = data_lib.member_labels(y, i, per_member)
        swi = data_lib.member_labels(sample_weight, i, sw_per_member)
        loss = ops.cast(member._compile_loss(yi, y_pred[i], swi), "float32")
        if not training:
            member._loss_tracker.update_state(loss, sample_weight=batch)
            terms.append(loss)
            continue
        active = ops.equal(status[i], ACTIVE)
        ok = ops.logical_and(active, ops.isfinite(loss))
        member._loss_tracker.update_state(
            ops.where(ok, loss, 0.0), sample_weight=ops.where(ok, batch, 0.0)
        )
        terms.append(loss * ops.where(active, 1.0, nan))
        finite.append(ops.isfinite(loss))
    if training and pack._on_nan == "freeze":
        frozen = ops.logical_and(ops.equal(status, ACTIVE), ops.logical_not(ops.stack(finite)))
        pack._status.assign(ops.where(frozen, FROZEN_NAN, status))
    total = ops.sum(ops.stack(terms))
    regularization = pack.losses
    if regularization:
        total = total + ops.cast(ops.sum(ops.stack(regularization)), "float32")
    return total


def compute_metrics(pack: ModelPack, x: Any, y: Any, y_pred: list, sample_weight: Any) -> dict:
    """Updates every member's compiled metrics and returns the pack's logs."""
    members = pack._members
    n = len(members)
    per_member = data_lib.labels_per_member(y, n)
    sw_per_member = per_member and isinstance(sample_weight, (list, tuple))
    for i, member in enumerate(members):
        yi = data_lib.member_labels(y, i, per_member)
        swi = data_lib.member_labels(sample_weight, i, sw_per_member)
        if member._compile_metrics is not None:
            member._compile_metrics.update_state(yi, y_pred[i], swi)
    return pack_logs(members)


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
