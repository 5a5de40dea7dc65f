"""What `VectorizedOptimizer` keeps of each member's Keras optimizer, checked up front."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack.fusion import _optimizer_rules

_SCHEDULE = keras.optimizers.schedules.LearningRateSchedule


@dataclasses.dataclass
class MemberSettings:
    """One member's optimizer as the vectorized optimizer applies it.

    Attributes:
        rule: the family's update rule.
        hyper: the family's hyperparameters, as floats.
        schedule: the learning-rate schedule, or `None` for a fixed rate.
        learning_rate: the initial fixed rate (0 with a schedule).
        weight_decay: the decoupled weight decay, or `None`.
        clip: `clipnorm`, `global_clipnorm` and `clipvalue`, each a float or `None`.
        loss_scale_factor: a fixed loss scale (`loss_scale_factor=`), or `None`.
        accumulation: `gradient_accumulation_steps`, or `None`.
        dynamic_scale: `(initial_scale, dynamic_growth_steps)` of a `LossScaleOptimizer`
            (mixed precision), or `None`.
    """

    rule: Any
    hyper: dict
    schedule: Any
    learning_rate: float
    weight_decay: float | None
    clip: dict
    loss_scale_factor: float | None
    accumulation: int | None
    dynamic_scale: tuple[float, int] | None


def outside_groups() -> MemberSettings:
    """Settings of a member no group holds (the graph engine trains it with its own)."""
    return MemberSettings(
        rule=None,
        hyper={},
        schedule=None,
        learning_rate=0.0,
        weight_decay=None,
        clip=dict.fromkeys(("clipnorm", "global_clipnorm", "clipvalue")),
        loss_scale_factor=None,
        accumulation=None,
        dynamic_scale=None,
    )


def _positive_or_none(optimizer: Any, name: str) -> float | None:
    value = getattr(optimizer, name, None)
    return None if value is None or value <= 0 else float(value)


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer a `LossScaleOptimizer` wraps, or `optimizer` itself."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def member_settings(index: int, optimizer: Any) -> MemberSettings:
    """Reads member `index`'s optimizer, or raises naming what has no vectorized form."""
    supported = _optimizer_rules.supported_names()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"Invalid optimizer for member {index}: expected a `keras.optimizers.Optimizer`, "
            f"got {type(optimizer).__name__}. Pass one of: {supported}."
        )
    dynamic = None
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        dynamic = (float(optimizer.initial_scale), int(optimizer.dynamic_growth_steps))
    inner = inner_optimizer(optimizer)
    rule = _optimizer_rules.rule_for(inner)
    if rule is None:
        raise ValueError(
            f"Member {index}'s optimizer `{type(inner).__name__}` has no vectorized form. "
            f"Supported: {supported}."
        )
    excluded_keys, excluded_pattern = _upstream.weight_decay_exclusions(inner)
    unsupported = {
        "use_ema": inner.use_ema,
        "exclude_from_weight_decay": excluded_keys or excluded_pattern,
    }
    for name, value in unsupported.items():
        if value:
            raise ValueError(
                f"Member {index}'s optimizer sets `{name}={value!r}`, which the vectorized "
                f"optimizer does not support. Supported: {supported} with learning rates, "
                "schedules, their own hyperparameters, weight_decay, clipnorm, "
                "global_clipnorm, clipvalue, loss_scale_factor, "
                "gradient_accumulation_steps and mixed-precision loss scaling."
            )
    learning_rate = _upstream.raw_learning_rate(inner)
    if callable(learning_rate) and not isinstance(learning_rate, _SCHEDULE):
        raise ValueError(
            f"Member {index}'s optimizer has a callable learning rate that is not a "
            "`keras.optimizers.schedules.LearningRateSchedule`. Pass a float or a schedule."
        )
    schedule = learning_rate if isinstance(learning_rate, _SCHEDULE) else None
    return MemberSettings(
        rule=rule,
        hyper=rule.hyper(inner),
        schedule=schedule,
        learning_rate=0.0 if schedule else float(ops.convert_to_numpy(inner.learning_rate)),
        weight_decay=None if inner.weight_decay is None else float(inner.weight_decay),
        clip={
            name: _positive_or_none(inner, name)
            for name in ("clipnorm", "global_clipnorm", "clipvalue")
        },
        loss_scale_factor=_positive_or_none(inner, "loss_scale_factor"),
        accumulation=inner.gradient_accumulation_steps or None,
        dynamic_scale=dynamic,
    )


class MemberLearningRate:
    """Member `index`'s learning rate inside a `VectorizedOptimizer`, settable as Keras's.

    Keras's learning-rate callbacks (`LearningRateScheduler`, `ReduceLROnPlateau`) read and
    set `optimizer.learning_rate`; handed this object as a member's optimizer, they change
    that member's rate in the vectorized optimizer, from the next step on.

    Args:
        optimizer: the `VectorizedOptimizer`.
        index: the member.
        name: the member optimizer's name.
    """

    def __init__(self, optimizer: Any, index: int, name: str) -> None:
        self._optimizer = optimizer
        self._index = index
        self.name = name

    @property
    def learning_rate(self) -> Any:
        return self._optimizer.member_learning_rates()[self._index]

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        if self._optimizer.member_schedule(self._index) is not None:
            raise TypeError(
                "This optimizer was created with a `LearningRateSchedule` object as its "
                "`learning_rate` constructor argument, hence its learning rate is not "
                "settable. If you need the learning rate to be settable, you should "
                "instantiate the optimizer with a float `learning_rate` argument."
            )
        if callable(value):
            raise TypeError(
                f"Invalid learning rate for member {self._index}: a ModelPack member's "
                "learning rate can be set to a float while it trains, not replaced by a "
                "schedule or a function. Give the member's optimizer its schedule before "
                "`compile`."
            )
        self._optimizer.set_member_learning_rate(self._index, float(value))
