"""How long a fused group's step takes, roughly: padding against separate programs.

Fusing members of different sizes pads every member to the widest, so a group computes more
than its members need; keeping them apart costs a program (kernels launched, ops dispatched,
an optimizer update) per group instead. The model counts both in floating-point operations
(FLOPs) per step:

- a layer with weights costs `2 * batch * positions * kernel * width_in * width_out` FLOPs
  per member (per member that has it, for layers that compute only those, such as
  Dense), at the group's padded widths (`positions`: output positions per sample, such
  as a sequence's steps; `kernel`: a convolution's window);
- every layer call of a group costs a fixed `overhead` as well, in FLOPs the device could
  have done meanwhile: `OVERHEAD_FLOPS`. On a GPU, 200 MFLOP: launching a kernel takes a
  few microseconds of a device doing tens of TFLOP/s. On a CPU, 10 MFLOP, measured on a
  2-core CPU where a fused step runs about 12 GFLOP/s of this model's FLOPs: each call
  dispatches its ops in every step (0.3 ms, 3.6 MFLOP) and is traced and optimized once
  per program (0.1-0.2 s: about 6 MFLOP a step over a 5-epoch fit of 300 steps).

A group's estimated step is the sum over its calls. `partition` merges groups while the
merged group costs less than the groups apart.

A layer that computes only the members that have it (Dense, for members of a depth search)
takes their slices of its input and kernel and pads the product back into place: as many
kernels again as the product, forward and backward, and a longer compile. Where the left-out
members' product costs no more than one call's overhead it computes every member's instead
(`computes_every_member`), and their rows are left out afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from keras_gpushare.pack._backend import has_accelerator
from keras_gpushare.pack.fusion import registry

OVERHEAD_FLOPS = {"cpu": 1e7, "gpu": 2e8}
ASSUMED_BATCH = 32


def overhead_flops() -> float:
    """The fixed cost of one layer call of a group on this machine's device, in FLOPs."""
    return OVERHEAD_FLOPS["gpu" if has_accelerator() else "cpu"]


def computes_every_member(
    absent: int, rows: int, in_width: int, out_width: int, overhead: float | None = None
) -> bool:
    """Whether a layer left out by `absent` of its group's members computes their product
    too: when its FLOPs in a training step (the forward product and the two backward ones)
    are at most one layer call's overhead.

    Args:
        absent: members that leave the layer out.
        rows: rows of the product per member (batch times positions).
        in_width: the product's input width (the kernel's rows).
        out_width: its output width.
        overhead: one call's overhead in FLOPs. Defaults to `None`: `overhead_flops()`.
    """
    overhead = overhead_flops() if overhead is None else overhead
    return 6.0 * absent * rows * in_width * out_width <= overhead


@dataclasses.dataclass
class _Call:
    """One call of the template: its size per member (0 where a member leaves it out)."""

    ins: np.ndarray
    outs: np.ndarray
    # The padded widths below which no group of the plan goes: a capacity shared by the
    # template's searched calls (a pack built for slots, `_capacity`), else 0.
    in_floor: int
    out_floor: int
    present: np.ndarray
    positions: int
    kernel: int
    weighted: bool
    present_only: bool


class GroupCosts:
    """Per-member sizes of every call of a `FusionPlan`, to cost any subset of its members.

    Args:
        plan: the `report.FusionPlan` of the candidate members.
        batch: the batch size assumed. Defaults to `ASSUMED_BATCH`.
        overhead: FLOP-equivalents of one call of one group. Defaults to the device's.
    """

    def __init__(self, plan: Any, batch: int = ASSUMED_BATCH, overhead: float | None = None):
        self.batch = batch
        self.overhead = overhead_flops() if overhead is None else overhead
        self.calls = []
        n = len(plan.graphs)
        for t, tnode in enumerate(plan.template):
            node = tnode.first
            out_shape = node.outputs[0].shape
            in_shape = node.input_tensors[0].shape if node.input_tensors else out_shape
            in_layout = plan.layouts.get(plan.sources(t)[0]) if plan.sources(t) else None
            out_layout = plan.layouts.get(("node", t, 0))
            ins = _widths(in_layout, in_shape[-1], n)
            outs = _widths(out_layout, out_shape[-1], n)
            present = np.asarray([m is not None for m in tnode.nodes])
            layer = node.operation
            kernel = 1
            for weight in layer.weights[:1]:
                kernel = int(np.prod(weight.shape[:-2], dtype=int)) if len(weight.shape) > 2 else 1
            positions = int(np.prod([d or 1 for d in out_shape[1:-1]], dtype=int))
            fused_class = registry.fused_form(type(layer))
            self.calls.append(
                _Call(
                    ins,
                    outs,
                    _floor(in_layout, plan),
                    _floor(out_layout, plan),
                    present,
                    positions,
                    kernel,
                    bool(layer.trainable_weights),
                    bool(fused_class and fused_class.computes_present_only),
                )
            )

    def flops(self, members: Sequence[int]) -> tuple[float, float]:
        """`(padded, real)` FLOPs of a step of a group of these members (plan positions)."""
        group = np.asarray(list(members))
        padded = real = 0.0
        for call in self.calls:
            ins, outs = call.ins[group], call.outs[group]
            in_width, out_width = max(ins.max(), call.in_floor), max(outs.max(), call.out_floor)
            scale = 2.0 * self.batch * call.positions * call.kernel
            if call.weighted:
                computed = call.present[group].sum() if self._sliced(call, group) else len(group)
                padded += scale * computed * in_width * out_width
                real += scale * float(np.sum(ins * outs * call.present[group]))
            else:
                padded += self.batch * call.positions * len(group) * out_width
                real += self.batch * call.positions * float(np.sum(outs))
        return padded, real

    def cost(self, members: Sequence[int]) -> float:
        """The estimated step of a group of these members, in FLOP-equivalents."""
        members = list(members)
        calls = sum(1 for call in self.calls if call.present[members].any())
        return calls * self.overhead + self.flops(members)[0]

    def sliced_calls(self, group: Sequence[int]) -> list[int]:
        """The calls with weights that a group of `group` (plan positions) computes only for
        the members having them: left out by some, whose product is not cheap enough to
        compute for every member (`computes_every_member`)."""
        members = np.asarray(list(group))
        return [c for c, call in enumerate(self.calls) if self._sliced(call, members)]

    def _sliced(self, call: _Call, group: np.ndarray) -> bool:
        """Whether a group of `group` computes `call` only for the members having it."""
        if not (call.weighted and call.present_only):
            return False
        absent = len(group) - int(call.present[group].sum())
        rows = self.batch * call.positions * call.kernel
        ins, outs = call.ins[group], call.outs[group]
        in_width, out_width = max(ins.max(), call.in_floor), max(outs.max(), call.out_floor)
        return bool(absent) and not computes_every_member(
            absent, rows, in_width, out_width, self.overhead
        )

    def layers_of(self, member: int, calls: Sequence[int]) -> tuple[int, ...]:
        """For each of `calls` (see `sliced_calls`): 1 if `member` has it, else 0."""
        return tuple(int(self.calls[c].present[member]) for c in calls)

    def waste(self, members: Sequence[int]) -> float:
        """The share of a group's FLOPs that is padding."""
        padded, real = self.flops(members)
        return 0.0 if padded <= 0 else max(0.0, 1.0 - real / padded)


def _floor(layout: Any, plan: Any) -> int:
    """A tensor's padded width in a plan with a shared capacity (its layout's), else 0."""
    return int(layout.shape[1]) if plan.capacity and layout is not None else 0


def _widths(layout: Any, size: Any, n: int) -> np.ndarray:
    if layout is None:
        return np.full(n, float(size or 1))
    return layout.sum(axis=1).astype(float)


def partition(costs: GroupCosts, groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Merge `groups` (members of equal sizes) while merging lowers the estimated cost.

    Groups are taken from the smallest to the largest (by FLOPs), each merged into the
    group being formed when that costs less than keeping it apart, so members of similar
    sizes end up together. A merged group lists its members in ascending order: where
    nothing else orders a group (`planner._ordered`), its members are stacked in their own
    order, which the step then need not permute.
    """
    ordered = sorted((list(g) for g in groups), key=lambda g: costs.flops(g)[1] / len(g))
    result: list[list[int]] = []
    for group in ordered:
        if result:
            merged = sorted(result[-1] + group)
            if costs.cost(merged) < costs.cost(result[-1]) + costs.cost(group):
                result[-1] = merged
                continue
        result.append(group)
    return result
