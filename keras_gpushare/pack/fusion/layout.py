"""Which features of a padded stacked tensor are real, member by member.

When members of different sizes fuse, every stacked tensor is as wide as its widest member,
and member `i` owns only some of the features of its slice: the first `units_i` of a
`Dense(units_i)` output, say. A layout is the `(N, features)` boolean mask of the features of
a tensor's last axis (channels) that each member owns. A member's own features are the masked
ones in order, so its weights map to and from the stacked ones through the masks, and layouts
compose as the layers do: `Flatten` of `(height, width, channels)` repeats the channel layout
over the positions, `Concatenate` lays layouts side by side.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def full(size: int, n: int) -> np.ndarray:
    """`size` features, all real for all `n` members."""
    return np.ones((n, int(size)), dtype=bool)


def prefix(reals: Sequence[int], size: int | None = None) -> np.ndarray:
    """Member `i` owns the first `reals[i]` features of `size` (default: the widest)."""
    lengths = np.asarray([int(r) for r in reals])
    size = int(lengths.max()) if size is None else int(size)
    return np.arange(size)[None, :] < lengths[:, None]


def product(outer: np.ndarray, inner: np.ndarray) -> np.ndarray:
    """Features of two axes flattened together (C order): `inner` varies fastest."""
    return (outer[:, :, None] & inner[:, None, :]).reshape(len(outer), -1)


def repeat(layout: np.ndarray, times: int) -> np.ndarray:
    """`layout` for every one of `times` positions (flattening spatial axes before it)."""
    return np.tile(layout, (1, int(times)))


def concat(layouts: Sequence[np.ndarray]) -> np.ndarray:
    """Layouts side by side."""
    return np.concatenate(list(layouts), axis=1)


def widen(layout: np.ndarray, size: int) -> np.ndarray:
    """`layout` with padding features appended up to `size`."""
    extra = int(size) - layout.shape[1]
    return np.concatenate([layout, np.zeros((len(layout), extra), dtype=bool)], axis=1)


def is_full(layout: np.ndarray | None) -> bool:
    """Whether every member owns every feature (no padding); `None` means full."""
    return layout is None or bool(np.all(layout))


def waste(layout: np.ndarray) -> float:
    """The share of the features that are padding."""
    return float(1.0 - layout.mean()) if layout.size else 0.0


def to_config(layout: np.ndarray | None) -> list | None:
    """A JSON-friendly form: per member, the `[start, stop)` runs of real features."""
    if layout is None:
        return None
    runs = []
    for row in layout:
        edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(int), [0]])))
        runs.append([[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2])])
    return [int(layout.shape[1]), runs]


def from_config(config: list | None) -> np.ndarray | None:
    """The layout `to_config` describes."""
    if config is None:
        return None
    size, runs = config
    layout = np.zeros((len(runs), int(size)), dtype=bool)
    for row, member_runs in zip(layout, runs):
        for start, stop in member_runs:
            row[start:stop] = True
    return layout
