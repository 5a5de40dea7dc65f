"""The optimizer Keras sees for a pack, and the graph engine as the fallback for members
whose optimizer has no vectorized form.

Fused groups train under one `VectorizedOptimizer` over their stacked weights; a pack with
no fused group hands Keras `MemberOptimizers`, the members' own optimizers. A fused member
whose optimizer cannot be vectorized moves to the graph engine on TensorFlow with
`fuse="auto"` (with a warning naming it); elsewhere that is an error naming it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import keras

from keras_gpushare.pack import planner
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack._compiling._optimizers import MemberOptimizers
from keras_gpushare.pack.engines.base import Engine, EngineOptions, GradientEngine
from keras_gpushare.pack.fusion import VectorizedOptimizer
from keras_gpushare.pack.fusion.settings import Settings

logger = logging.getLogger("keras_gpushare.pack.model")


def pack_optimizer(
    optimizers: list,
    gradient_engines: Sequence[GradientEngine],
    skip_nonfinite: bool,
    settings: Settings,
) -> keras.optimizers.Optimizer:
    """The optimizer Keras sees: vectorized over the gradient engines, or the members' own.

    Args:
        optimizers: each member's optimizer, in member order.
        gradient_engines: the engines whose members the pack's optimizer updates.
        skip_nonfinite: skip a member's non-finite update (`on_nan="freeze"`).
        settings: how the pack holds its members' settings (`fusion.settings`).
    """
    if not gradient_engines:
        return MemberOptimizers(optimizers)
    optimizer = VectorizedOptimizer(
        optimizers,
        groups=[engine.member_ids for engine in gradient_engines],
        skip_nonfinite=skip_nonfinite,
        settings=settings,
    )
    optimizer.set_variable_groups(
        [
            (variable, g)
            for g, engine in enumerate(gradient_engines)
            for layer in engine.keras_objects()
            for variable in layer.trainable_variables
        ]
    )
    return optimizer


def graph_fallback(
    pack_name: str,
    reasons: dict[int, str],
    fuse: str | bool,
    compiled: bool,
    plan: planner.EnginePlan,
    members: Sequence[keras.Model],
    engines: Sequence[Engine],
    options: EngineOptions,
) -> list[Engine]:
    """The engines with the members `reasons` names moved from their fused groups to the
    graph engine, or raises where the graph engine cannot take them.

    Args:
        pack_name: the pack's name, for the warning.
        reasons: why each member's optimizer cannot be vectorized, by member index.
        fuse: the pack's `fuse` argument.
        compiled: whether the pack was compiled before (with these members fused).
        plan: the pack's plan; updated in place.
        members: the pack's members.
        engines: the pack's engines.
        options: the engines' options.
    """
    reason = next(iter(reasons.values()))
    if fuse is True or not BACKEND.graph_engine:
        raise ValueError(
            f"Invalid value for argument `optimizer`: {reason} The fused engine cannot "
            "train it; the graph engine can, on the TensorFlow backend with "
            'fuse="auto" or fuse=False.'
        )
    if compiled:
        raise ValueError(
            f"Invalid value for argument `optimizer`: {reason} This pack was compiled "
            "with these members fused before; build a new pack to train them."
        )
    moved = planner.move_to_graph(
        plan,
        list(members),
        list(engines),
        {i: f"not fused: its optimizer cannot be vectorized: {r}" for i, r in reasons.items()},
        options,
    )
    message = (
        f"ModelPack {pack_name}: members {sorted(reasons)} train on the graph engine, "
        f"not fused: {reason}"
    )
    logger.warning(message)
    warnings.warn(message, stacklevel=3)
    return moved
