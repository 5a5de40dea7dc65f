"""`Plan`: which layers run on which device, with parameter counts and memory estimates."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from keras_gpushare.placement import _costs
from keras_gpushare.placement._graph import StageGraph


@dataclasses.dataclass(frozen=True)
class PlanStage:
    """One row of a `Plan`: a stage's device, layers, parameters and estimated memory."""

    index: int
    device: str
    layers: tuple[str, ...]
    params: int
    weight_bytes: int
    activation_bytes: int

    @property
    def memory_bytes(self) -> int:
        """Estimated peak bytes: weights, gradients, optimizer slots and activations."""
        return self.weight_bytes + self.activation_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a placed model is split: stages, devices, layers, parameters, estimated memory.

    Memory per stage is an estimate: weights plus gradient and two optimizer slots per
    trainable weight (Adam), plus the stage's activations kept for the backward at
    `batch_size` (all micro-batches' activations in a GPipe schedule; with recomputation
    only the stage borders plus one micro-batch). `str(plan)` is a readable table.

    Args:
        stages: One `PlanStage` per stage, in order.
        batch_size: Batch size the activation estimate assumes. Defaults to `32`.
        microbatches: Micro-batches per batch. Defaults to `1`.
        recompute: Whether stages recompute their forward in the backward. Defaults to
            `False`.

    Example:

    ```python
    import keras
    import keras_gpushare as kg

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    plan = kg.split_model(model, devices=["/CPU:0", "/CPU:0"]).plan
    print(plan.devices, plan.params)
    print(plan)
    ```
    """

    stages: tuple[PlanStage, ...]
    batch_size: int = 32
    microbatches: int = 1
    recompute: bool = False

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    @property
    def layer_names(self) -> list[list[str]]:
        return [list(s.layers) for s in self.stages]

    @property
    def params(self) -> list[int]:
        return [s.params for s in self.stages]

    @property
    def memory_bytes(self) -> list[int]:
        return [s.memory_bytes for s in self.stages]

    def __str__(self) -> str:
        header = ("stage", "device", "layers", "params", "est. memory", "first .. last layer")
        rows = [
            (
                str(s.index),
                s.device,
                str(len(s.layers)),
                f"{s.params:,}",
                _human(s.memory_bytes),
                f"{s.layers[0]} .. {s.layers[-1]}" if len(s.layers) > 1 else s.layers[0],
            )
            for s in self.stages
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            f"Plan: {len(self.stages)} stages, microbatches={self.microbatches}, "
            f"recompute={self.recompute}, memory estimated at batch size {self.batch_size}",
            "  ".join(h.ljust(w) for h, w in zip(header, widths)),
            "  ".join("-" * w for w in widths),
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(line.rstrip() for line in lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def make_plan(
    stages: Sequence[StageGraph], batch_size: int, microbatches: int, recompute: bool
) -> Plan:
    """Builds the `Plan` of stage graphs."""
    rows = []
    for st in stages:
        per_sample = _costs.activation_bytes(st.nodes)
        if recompute:
            border = sum(
                _costs.activation_bytes([n])
                for n in st.nodes
                if any(id(t) in st.outputs for t in n.outputs)
            )
            activations = border * batch_size + per_sample * batch_size // microbatches
        else:
            activations = per_sample * batch_size
        rows.append(
            PlanStage(
                index=st.index,
                device=st.device,
                layers=tuple(layer.name for layer in st.layers),
                params=sum(_costs.param_count(layer) for layer in st.layers),
                weight_bytes=sum(_costs.weight_bytes(layer) for layer in st.layers),
                activation_bytes=int(activations),
            )
        )
    return Plan(tuple(rows), batch_size, microbatches, recompute)
