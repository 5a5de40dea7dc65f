"""What `keras-gpushare bench` measures: member counts, data size, methods, repeats."""

from __future__ import annotations

import dataclasses
from typing import Any

METHODS = ("sequential", "pool", "pack-graph", "pack-fused")
_MIXED_WIDTHS = (16, 32, 48, 64)
ARCHITECTURES = ("same", "mixed", "varied")
ARCHITECTURE_LINES = {
    "same": "widths 64",
    "mixed": "first hidden widths 16/32/48/64",
    "varied": "first hidden widths 16/32/48/64, 1-3 hidden layers, relu or tanh",
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `keras-gpushare bench` measures.

    Args:
        members: member counts to run. Defaults to `(1, 4, 16)`.
        samples: training rows per epoch. Defaults to `25_000`.
        epochs: epochs per run, warm-up included. Defaults to `5`.
        methods: methods to run, from `METHODS`. Defaults to all of them.
        architecture: `"same"` (all the seeds' 10-64-32-1 model), `"mixed"` (first
            hidden widths 16/32/48/64 in turn) or `"varied"` (those widths, 1-3 hidden
            layers and relu or tanh, in turn); the fused engine pads what differs.
            Defaults to `"same"`.
        warmup: epochs left out of the steady rate (the median of the others). Defaults to
            `2`.
        repeats: how many times every run is repeated, in turn. Defaults to `3`.
        threads: threads per process for TensorFlow's pools (0: TensorFlow's default).
            Defaults to `0`.
    """

    members: tuple[int, ...] = (1, 4, 16)
    samples: int = 25_000
    epochs: int = 5
    methods: tuple[str, ...] = METHODS
    architecture: str = "same"
    warmup: int = 2
    repeats: int = 3
    threads: int = 0

    def __post_init__(self) -> None:
        if self.epochs <= self.warmup:
            raise ValueError(
                f"Invalid value for --epochs: got {self.epochs} with {self.warmup} warm-up "
                f"epochs. Pass at least {self.warmup + 1} so that an epoch is timed."
            )

    @classmethod
    def quick(cls) -> BenchConfig:
        """A run of about a minute on two CPU cores: the `make demo` job (the seeds' model)."""
        return cls(members=(1, 4), samples=5_000, epochs=4, repeats=1, architecture="same")

    @classmethod
    def full(cls) -> BenchConfig:
        """The benchmark of `make bench` and docs/benchmarks.md."""
        return cls()

    def with_overrides(
        self,
        members: str | None = None,
        samples: int | None = None,
        epochs: int | None = None,
        methods: str | None = None,
        architecture: str | None = None,
        repeats: int | None = None,
        threads: int | None = None,
    ) -> BenchConfig:
        """Returns a copy with the command line's choices applied (None keeps a field)."""
        changes: dict[str, Any] = {}
        if members:
            changes["members"] = tuple(_positive(v, "--members") for v in _ints(members))
        if samples is not None:
            changes["samples"] = _positive(samples, "--samples")
        if epochs is not None:
            changes["epochs"] = _positive(epochs, "--epochs")
        if methods:
            chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
            unknown = [m for m in chosen if m not in METHODS]
            if unknown:
                raise ValueError(
                    f"Invalid value for --methods: unknown {unknown}. Choose from "
                    f"{', '.join(METHODS)}."
                )
            changes["methods"] = chosen
        if architecture is not None:
            if architecture not in ARCHITECTURES:
                raise ValueError(
                    f"Invalid value for --architecture: got {architecture!r}. Expected one of "
                    f"{', '.join(ARCHITECTURES)}."
                )
            changes["architecture"] = architecture
        if repeats is not None:
            changes["repeats"] = _positive(repeats, "--repeats")
        if threads is not None:
            if threads < 0:
                raise ValueError(
                    f"Invalid value for --threads: got {threads}, expected 0 (TensorFlow's "
                    "default) or a positive number of threads."
                )
            changes["threads"] = threads
        return dataclasses.replace(self, **changes)

    def widths(self, n: int) -> list[Any]:
        """Each of `n` members' `build_mlp` spec (a first hidden width, or a full spec)."""
        if self.architecture == "same":
            return [64] * n
        widths = [_MIXED_WIDTHS[i % len(_MIXED_WIDTHS)] for i in range(n)]
        if self.architecture == "mixed":
            return widths
        return [[w, 1 + (i // 4) % 3, ("relu", "tanh")[(i // 2) % 2]] for i, w in enumerate(widths)]


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise ValueError(f"Invalid value for {flag}: got {value}, expected a positive integer.")
    return value


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"Invalid value for --members: got {text!r}, expected comma-separated integers "
            "such as 1,4,16."
        ) from None
