"""Each member's loss in the pack's step: summed, scaled per member, and the status it sets.

The pack's loss is the sum of its active members' own losses. Under mixed precision each
member scales its loss by its own dynamic loss scale (a trainable variable of the pack,
whose gradient is the member's loss: the vectorized optimizer reads from it which members
trained this step), times a fixed factor of its optimizer's. A member whose loss is not
finite is frozen by its engine (`on_nan="freeze"`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gpushare.pack._status import FROZEN_NAN
from keras_gpushare.pack.engines.base import GradientEngine
from keras_gpushare.pack.fusion import VectorizedOptimizer


def summed_loss(
    gradient_engines: Sequence[GradientEngine],
    outputs: Sequence[Any],
    batch: tuple[Any, Any, Any],
    status: Any,
    scales: Any,
    training: bool,
) -> tuple[Any, Any]:
    """The sum of the active members' losses, and the members' status after this step.

    Args:
        gradient_engines: the engines whose members the pack's optimizer updates.
        outputs: each engine's share of the pack's outputs.
        batch: `(x, y, sample_weight)`.
        status: the members' status codes, a tensor.
        scales: each member's loss scale (`loss_scales`), or `None`.
        training: whether this is a training step (which may freeze members).
    """
    x, y, sample_weight = batch
    new_status = status
    total = ops.convert_to_tensor(0.0)
    for engine, raw in zip(gradient_engines, outputs):
        current = engine.member_rows(status)
        losses, freeze = engine.loss(x, y, raw, sample_weight, current, training)
        if scales is not None:
            losses = losses * engine.member_rows(scales)
        total = total + ops.sum(losses)
        if training:
            new_status = engine.with_member_rows(new_status, ops.where(freeze, FROZEN_NAN, current))
    return total, new_status


def loss_scales(optimizer: Any, loss_scale: Any) -> Any:
    """Each member's loss scale in training (fixed factor times dynamic scale), or None.

    Args:
        optimizer: the pack's optimizer.
        loss_scale: the members' dynamic loss scales (`attach_loss_scale`), or `None`.
    """
    if not isinstance(optimizer, VectorizedOptimizer):
        return None
    factors = optimizer.loss_scale_factors()
    if loss_scale is None:
        return None if np.all(factors == 1.0) else ops.convert_to_tensor(factors)
    return ops.convert_to_tensor(factors) * ops.convert_to_tensor(loss_scale)


def attach_loss_scale(
    optimizer: Any, loss_scale: Any, add_weight: Callable[..., Any], n_members: int
) -> Any:
    """Gives the members' dynamic loss scales (mixed precision) a variable, when needed.

    Args:
        optimizer: the pack's optimizer.
        loss_scale: the variable made before, or `None`.
        add_weight: the pack's `add_weight`, which makes the variable.
        n_members: the number of members.

    Returns:
        The variable (`loss_scale` when there was one), or `None` when no member scales
        its loss dynamically.
    """
    if not isinstance(optimizer, VectorizedOptimizer) or not optimizer.uses_dynamic_loss_scale:
        return loss_scale
    if loss_scale is None:
        loss_scale = add_weight(
            name="member_loss_scale",
            shape=(n_members,),
            initializer=keras.initializers.Constant(optimizer.initial_loss_scales()),
            trainable=True,
        )
    optimizer.attach_loss_scale(loss_scale)
    return loss_scale
