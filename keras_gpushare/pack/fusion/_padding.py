"""Masks that keep the padding of fused weights at zero (see `layout`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from keras import ops


def outer(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """`(N, r, c)`: member `i` owns entry `(a, b)` when it owns row `a` and column `b`."""
    return rows[:, :, None] & cols[:, None, :]


def mask_or_none(mask: np.ndarray) -> np.ndarray | None:
    """`mask`, or `None` when every entry is real (no padding to mask)."""
    return None if bool(np.all(mask)) else mask


def masked(weight: Any, mask: np.ndarray | None) -> Any:
    """`weight` with its padding zeroed.

    Multiplying by the mask in the forward pass keeps the padding's gradient exactly
    zero, so every optimizer leaves padding that starts at zero at zero.
    """
    if mask is None:
        return weight
    return weight * ops.convert_to_tensor(mask.astype("float32"), dtype=weight.dtype)
