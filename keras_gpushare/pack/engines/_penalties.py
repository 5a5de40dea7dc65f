"""Members' regularization penalties on a fused group's stacked weights.

What Keras adds to one member's loss in its own `fit` is the sum of its own regularizers
applied to its own trainable weights. On stacked weights that is, for each member, its
regularizers on its slice (padding left out). Fused layers take only Keras's additive
regularizers (`L1`, `L2`, `L1L2`; `fusion/_checks.py` refuses others), so every member's
penalty is computed at once: per-member strengths held as data, the padding masked out, one
reduction over each stacked weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops


def _strengths(regularizer: Any) -> tuple[float, float]:
    """`(l1, l2)` of one of Keras's additive regularizers (`L1`, `L2`, `L1L2`)."""
    return float(getattr(regularizer, "l1", 0.0)), float(getattr(regularizer, "l2", 0.0))


def _ownership(shape: tuple, parts: list) -> np.ndarray:
    """1 where a member's own weight lies in its slice of a stacked weight, 0 on padding."""
    mask = np.zeros(shape, dtype="float32")
    for j, index, _ in parts:
        if index is None:
            mask[j] = 1.0
            continue
        axes = [np.arange(s) if p is None else np.asarray(p) for s, p in zip(shape[1:], index)]
        mask[j][np.ix_(*axes)] = 1.0
    return mask


class _Stacked:
    """One stacked weight's penalties for every member: `(k,)` at once."""

    def __init__(self, variable: Any, parts: list, k: int) -> None:
        self.variable = variable
        l1 = np.zeros((k,), "float32")
        l2 = np.zeros((k,), "float32")
        for j, _, regularizer in parts:
            l1[j], l2[j] = _strengths(regularizer)
        self.l1 = l1 if l1.any() else None
        self.l2 = l2 if l2.any() else None
        # Padding is masked out; a member without a regularizer has strength 0.
        whole = all(index is None for _, index, _ in parts)
        self.mask = None if whole else _ownership(tuple(variable.shape), parts)

    def __call__(self) -> Any:
        value = ops.convert_to_tensor(self.variable)
        axes = tuple(range(1, len(value.shape)))
        mask = None if self.mask is None else ops.convert_to_tensor(self.mask, value.dtype)
        total = None
        for strength, term in ((self.l1, ops.absolute), (self.l2, ops.square)):
            if strength is None:
                continue
            part = term(value)
            if mask is not None:
                part = part * mask
            part = ops.cast(strength, value.dtype) * ops.sum(part, axis=axes)
            total = part if total is None else total + part
        return ops.cast(total, "float32")


class MemberPenalties:
    """Every member's regularization penalty, shape `(k,)`: what Keras adds to its loss.

    Each member's own regularizers act on its own part of the stacked weights, so a
    member's logged loss includes its own penalty, as in plain `fit`, whatever strengths
    the other members use (a member without a regularizer adds nothing).

    Args:
        fused: the group's `FusedModel`.
        members: its members, in slot order.
    """

    def __init__(self, fused: Any, members: Sequence[keras.Model]) -> None:
        k = len(members)
        trainable = [{id(v) for v in member.trainable_weights} for member in members]
        self.terms: list[_Stacked] = []
        for variable, pairs in fused.member_variable_map(members):
            parts = [
                (j, index, own.regularizer)
                for j, (own, index) in enumerate(pairs)
                if own is not None
                and getattr(own, "regularizer", None) is not None
                and id(own) in trainable[j]
            ]
            if parts:
                self.terms.append(_Stacked(variable, parts, k))

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __call__(self) -> Any:
        total = self.terms[0]()
        for term in self.terms[1:]:
            total = total + term()
        return total
