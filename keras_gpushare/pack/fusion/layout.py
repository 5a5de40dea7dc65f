"""Which features of a padded stacked tensor are real, member by member.

When members of different sizes fuse, every stacked tensor is as wide as its widest member,
and member `i` owns only some of the features of its slice: the first `units_i` of a
`Dense(units_i)` output, say. A `Layout` describes the features of a tensor's last axis
(channels) for every member:

- `Dim(size, reals)`: `size` features, of which member `i` owns the first `reals[i]`;
- `Product(parts)`: the features of several axes flattened together (`Flatten` of a
  `(height, width, channels)` tensor is `Product([Dim(h), Dim(w), channels])`);
- `Concat(parts)`: features laid side by side (`Concatenate`).

`mask()` gives the `(N, size)` boolean mask of real features; a member's own features are
the masked ones in order, so its weights map to and from the stacked ones with the masks.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Dim:
    """`size` features; member `i` owns the first `reals[i]`."""

    size: int
    reals: tuple[int, ...]

    def mask(self) -> np.ndarray:
        return np.arange(self.size)[None, :] < np.asarray(self.reals)[:, None]

    def to_config(self) -> list:
        return ["dim", self.size, list(self.reals)]


@dataclasses.dataclass(frozen=True)
class Product:
    """The features of several axes flattened together (C order)."""

    parts: tuple

    @property
    def size(self) -> int:
        return int(np.prod([p.size for p in self.parts]))

    def mask(self) -> np.ndarray:
        result = self.parts[0].mask()
        for part in self.parts[1:]:
            other = part.mask()
            result = (result[:, :, None] & other[:, None, :]).reshape(len(result), -1)
        return result

    def to_config(self) -> list:
        return ["product", [p.to_config() for p in self.parts]]


@dataclasses.dataclass(frozen=True)
class Concat:
    """Features laid side by side."""

    parts: tuple

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def mask(self) -> np.ndarray:
        return np.concatenate([p.mask() for p in self.parts], axis=1)

    def to_config(self) -> list:
        return ["concat", [p.to_config() for p in self.parts]]


Layout = Dim | Product | Concat


def full(size: int, n: int) -> Dim:
    """`size` features, all real for all `n` members."""
    return Dim(int(size), (int(size),) * n)


def prefix(reals: list[int] | tuple[int, ...], size: int | None = None) -> Dim:
    """Member `i` owns the first `reals[i]` features of `size` (default: the widest)."""
    reals = tuple(int(r) for r in reals)
    return Dim(max(reals) if size is None else int(size), reals)


def is_full(layout: Layout) -> bool:
    """Whether every member owns every feature (no padding)."""
    return bool(np.all(layout.mask()))


def real_sizes(layout: Layout) -> list[int]:
    """How many features each member owns."""
    return [int(c) for c in layout.mask().sum(axis=1)]


def padding_waste(layout: Layout) -> float:
    """The share of the features that are padding (0 without padding)."""
    mask = layout.mask()
    return float(1.0 - mask.mean()) if mask.size else 0.0


def from_config(config: list) -> Layout:
    """The layout `to_config()` describes."""
    kind = config[0]
    if kind == "dim":
        return Dim(int(config[1]), tuple(int(r) for r in config[2]))
    parts = tuple(from_config(c) for c in config[1])
    return Product(parts) if kind == "product" else Concat(parts)
