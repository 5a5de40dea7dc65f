"""The fused engine's stacked losses: N members' compiled losses as a few calls at once.

Members whose losses are alike are grouped (`loss_groups` for members of one output,
`output_losses` output by output for members of several), and each group's loss is one call
on its members' rows of the stacked predictions (`grouped_losses`), instead of N small loss
computations in the step. `FusedEngine` decides which applies and calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops, tree

from keras_gpushare import _upstream
from keras_gpushare.pack import data as data_lib

# The key of a fused group's stacked outputs in training, when its members have several
# outputs and their losses are computed stacked (a dict: a pytree on every backend).
STACKED_OUTPUTS = "stacked_outputs"


def stacked_structure(y_pred: Any) -> Any:
    """The stacked outputs in a member's output structure, leaves `(N, B, ...)`: from the
    training call's stacked outputs, or from the per-member list (one stack per leaf)."""
    if isinstance(y_pred, dict) and STACKED_OUTPUTS in y_pred:
        return y_pred[STACKED_OUTPUTS]
    if not isinstance(y_pred, list):  # one output, stacked already
        return y_pred
    return tree.map_structure(lambda *leaves: ops.stack(leaves), *y_pred)


def output_losses_stack(members: Sequence[keras.Model], compile_args: Sequence[dict]) -> bool:
    """Whether members of several outputs compile losses of Keras's own only (each member
    its own, and its own loss weights): their losses and loss trackers can then be computed
    stacked, output by output, a call per distinct loss (`FusedEngine._stacked_output_losses`)."""
    if any((data_lib.output_count(m) or 1) < 2 for m in members):
        return False
    return all(_keras_own_loss(args["loss"]) for args in compile_args)


class OutputLoss:
    """One output's part of the members' compiled losses, computed stacked: its `path`
    into the outputs, its loss `groups` (`OneLoss`, a call each), every member's loss
    weight (`weights`, a `(N,)` array; None where every member's is 1), and the name of
    member 0's tracker of it (`<output>_loss`), or None."""

    def __init__(self, path: Any, groups: list, weights: Any, tracker: str | None) -> None:
        self.path = path
        self.groups = groups
        self.weights = weights
        self.tracker = tracker


def output_losses(parts: list[list]) -> list[OutputLoss] | None:
    """The members' compiled losses (`loss_parts` of each member's `CompileLoss`, compiled
    from Keras's own losses: `output_losses_stack`) output by output, or None unless every
    part is reduced to one number and the members' parts line up (paths, trackers). Members
    of one loss (by configuration) form a group."""
    first = parts[0]
    if any(len(p) != len(first) for p in parts):
        return None
    found = []
    for k, (path, _, _, tracker) in enumerate(first):
        column = [p[k] for p in parts]
        if any(tuple(c[0]) != tuple(path) or (c[3] is None) != (tracker is None) for c in column):
            return None
        by_key: dict[str, tuple[Any, list[int]]] = {}
        for j, (_, fn, _, _) in enumerate(column):
            if not isinstance(fn, keras.losses.Loss) or fn.reduction not in _SCALAR_REDUCTIONS:
                return None
            key = str(keras.saving.serialize_keras_object(fn))
            by_key.setdefault(key, (fn, []))[1].append(j)
        groups = [OneLoss.of(fn, False, ids, len(parts)) for fn, ids in by_key.values()]
        weights = [1.0 if c[2] is None else float(c[2]) for c in column]
        vector = None if all(w == 1.0 for w in weights) else np.asarray(weights, "float32")
        found.append(OutputLoss(path, groups, vector, None if tracker is None else tracker.name))
    return found


def loss_groups(
    members: Sequence[keras.Model], compile_args: Sequence[dict]
) -> list[OneLoss] | None:
    """The members' losses as groups each computed at once, or None.

    That holds when every member has one output and no loss weights, and each member's loss
    is one of Keras's own (grouped by configuration) or a loss object of the user's (grouped
    by identity: one function or `Loss` instance compiled into several members), reduced to
    one number: then one call per group on its stacked predictions gives its members'
    losses, instead of N small loss computations in the step. Keras's own losses with the
    default reduction are called once on the stacked predictions; every other loss (a
    user's, another reduction) is called as Keras calls it for one model, `Loss.__call__`
    with the sample weights, vectorized over the members (`keras.ops.vectorized_map`), so it
    computes exactly what it computes for one model, one value per batch included.
    """
    if any(args.get("loss_weights") is not None for args in compile_args):
        return None
    if any(data_lib.output_count(m) != 1 for m in members):
        return None
    # The members of each loss, by a key naming it: (its spec, whether a user's, members).
    by_key: dict[str, tuple[Any, bool, list[int]]] = {}
    for j, args in enumerate(compile_args):
        leaves = tree.flatten(args["loss"])
        if len(leaves) != 1:
            return None
        spec = leaves[0]
        if _keras_own_loss(spec):
            key, users = f"keras {keras.saving.serialize_keras_object(spec)}", False
        elif not isinstance(spec, str) and callable(spec):
            key, users = f"user {id(spec)}", True
        else:
            return None
        by_key.setdefault(key, (spec, users, []))[2].append(j)
    groups = []
    for spec, users, indices in by_key.values():
        loss = spec if users else keras.losses.get(spec)
        if not isinstance(loss, keras.losses.Loss):
            loss = _upstream.loss_function_wrapper()(loss)
        if getattr(loss, "reduction", None) not in _SCALAR_REDUCTIONS:
            return None
        groups.append(OneLoss.of(loss, users, indices, len(compile_args)))
    return groups


# The reductions that make a loss one number, as Keras's `CompileLoss` sums it.
_SCALAR_REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight")


class OneLoss:
    """A loss some members compile (`members`: their positions in the group, None for
    all), and whether it is called once on their stacked predictions (Keras's own, the
    default reduction) or as Keras calls it for one model, mapped over the members."""

    def __init__(self, loss: keras.losses.Loss, mapped: bool, members: list[int] | None) -> None:
        self.loss = loss
        self.mapped = mapped
        self.members = members
        # False once this backend could not vectorize a mapped loss: it is then computed
        # member by member.
        self.stacked = True

    @classmethod
    def of(cls, loss: keras.losses.Loss, users: bool, members: list[int], n: int) -> OneLoss:
        """The group of `members` (of `n` in all) compiling `loss` (`users`: a user's):
        mapped unless Keras's own of the default reduction."""
        mapped = users or loss.reduction != "sum_over_batch_size"
        return cls(loss, mapped, None if len(members) == n else members)


def grouped_losses(
    groups: list[OneLoss], y: Any, y_pred: Any, sample_weight: Any, per_member: bool
) -> Any:
    """Every member's loss, shape (N,), one `_stacked_losses` call per group on its
    members' rows of the stacked predictions (and, `per_member`, of the stacked labels and
    sample weights)."""
    stacked = tree.flatten(stacked_structure(y_pred))[0]
    parts, order = [], []
    for group in groups:
        rows, labels, weights = stacked, y, sample_weight
        if group.members is not None:
            rows = ops.take(stacked, group.members, axis=0)
            if per_member:
                labels = ops.take(y, group.members, axis=0)
                if weights is not None:
                    weights = ops.take(weights, group.members, axis=0)
        values = _stacked_losses(group.loss, labels, rows, weights, group.mapped, per_member)
        if group.members is None:
            return values
        parts.append(values)
        order.extend(group.members)
    return ops.take(ops.concatenate(parts), np.argsort(order), axis=0)


def _keras_own_loss(spec: Any) -> bool:
    """Whether every loss in `spec` is Keras's own: a Keras loss function or `Loss` class,
    or the name of one.

    Those give one value per sample, and their configuration is all they compute with. A
    user's function may reduce over the batch (on stacked predictions, over the members
    too), and two of one name (closures over different constants) serialize alike.
    """
    wrapper = _upstream.loss_function_wrapper()
    for leaf in tree.flatten(spec):
        leaf = keras.losses.get(leaf) if isinstance(leaf, str) else leaf
        if isinstance(leaf, keras.losses.Loss):
            own = type(leaf) is not wrapper and _upstream.is_keras_builtin(type(leaf))
        else:
            own = getattr(leaf, "__module__", "").startswith("keras.")
        if not own:
            return False
    return True


def _stacked_losses(
    fn: keras.losses.Loss,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
    mapped: bool = False,
    per_member: bool = False,
) -> Any:
    """Every member's loss, shape (N,), from one call on the stacked predictions.

    With `mapped` (a user's loss, or another reduction) the loss is called as Keras's
    `CompileLoss` calls it for one model (`fn(y, pred, sample_weight)`), vectorized over the
    members; else `fn.call` on the stacked predictions, reduced per member over the batch.
    `y` and `sample_weight` are one member's, shared, or with `per_member` every member's,
    stacked `(N, B, ...)`.
    """
    stacked = tree.flatten(stacked_structure(y_pred))[0]
    y = tree.flatten(y)[0]
    if mapped:
        if not per_member:
            values = ops.vectorized_map(lambda pred: fn(y, pred, sample_weight), stacked)
        elif sample_weight is None:
            values = ops.vectorized_map(lambda args: fn(*args), (y, stacked))
        else:
            values = ops.vectorized_map(lambda args: fn(*args), (y, stacked, sample_weight))
        return ops.cast(values, "float32")
    if not per_member:
        y = ops.broadcast_to(ops.expand_dims(y, 0), (stacked.shape[0], *ops.shape(y)))
    values = ops.cast(fn.call(y, stacked), "float32")
    if sample_weight is not None:
        weight = ops.cast(tree.flatten(sample_weight)[0], "float32")
        rank = len(values.shape) if per_member else len(values.shape) - 1
        while len(weight.shape) < rank:
            weight = ops.expand_dims(weight, -1)
        while len(weight.shape) > rank:
            weight = ops.squeeze(weight, -1)
        values = values * weight
    axes = tuple(range(1, len(values.shape)))
    return ops.sum(values, axis=axes) / ops.cast(ops.prod(ops.shape(values)[1:]), "float32")
