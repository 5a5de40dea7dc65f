"""The protocol every engine of a `ModelPack` follows.

An engine trains some of a pack's members (a "group") by one method. The pack builds its
engines, hands each its members, their positions in the pack (`member_ids`) and the options
it needs, and calls them; an engine never sees the pack. Two kinds exist:

- engines whose members are updated by the pack's optimizer from the gradient of the summed
  loss (`updates_itself = False`): they compute member outputs and losses, and the pack's
  Keras training step (any backend) does the rest;
- engines that update their members themselves inside the step (`updates_itself = True`,
  TensorFlow only): `train` runs forward, backward and each member's own optimizer.

Each engine reports, per member, the figures the pack turns into its logs (`MemberFigures`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras


@dataclasses.dataclass
class EngineOptions:
    """What an engine needs to know about the pack it serves.

    Attributes:
        output_counts: every member's number of outputs (`None` where unknown), in member
            order; how labels are split between members depends on them.
        on_nan: `"freeze"` or `"ignore"`.
        data_mode: `"replicate"` or `"shard"`.
    """

    output_counts: tuple
    on_nan: str = "freeze"
    data_mode: str = "replicate"


@dataclasses.dataclass
class MemberFigures:
    """One member's figures since the metrics were last reset.

    Attributes:
        loss: the member's mean loss (a scalar tensor).
        ran: whether the member ran a step since the reset (a boolean tensor).
        metrics: the member's other figures by its own key (`mae`, `price_loss`, ...).
    """

    loss: Any
    ran: Any
    metrics: dict


class Engine:
    """Base class of the engines of a `ModelPack` (see the module docstring).

    Args:
        members: the member models of this group, in `member_ids` order.
        member_ids: each member's position in the pack.
        options: the pack's `EngineOptions`.
    """

    kind = ""
    updates_itself = False

    def __init__(
        self, members: Sequence[keras.Model], member_ids: Sequence[int], options: EngineOptions
    ) -> None:
        self.members = list(members)
        self.member_ids = tuple(int(i) for i in member_ids)
        self.options = options

    def keras_objects(self) -> list:
        """The Keras layers and models the pack tracks for this engine (weights, saving)."""
        raise NotImplementedError

    @property
    def metrics(self) -> list:
        """The metric objects whose state the pack resets each epoch."""
        raise NotImplementedError

    def configure(self, compile_args: Sequence[dict]) -> None:
        """Prepares for training compiled members (`compile_args[j]`: member j's arguments)."""

    def call(self, inputs: Any, training: bool | None = None, active: Any = None) -> Any:
        """This group's raw outputs for `inputs` (the pack's whole inputs).

        Args:
            inputs: the pack's inputs.
            training: whether this is a training call.
            active: in training, whether each member of the group trains (a (k,) boolean
                tensor); members that do not keep their layer state.
        """
        raise NotImplementedError

    def member_outputs(self, raw: Any) -> list:
        """Each member's own outputs from `call`'s raw outputs."""
        raise NotImplementedError

    def figures(self) -> list[MemberFigures]:
        """Each member's figures, in `member_ids` order."""
        raise NotImplementedError

    def sync_members(self, optimizer: Any = None) -> None:
        """Makes the member models hold this engine's current weights and optimizer state.

        Args:
            optimizer: the pack's optimizer, which may hold the members' optimizer state.
        """

    def get_member_weights(self, j: int) -> list:
        """Member j's weights (j indexes this group), as `member.get_weights()` orders them."""
        return self.members[j].get_weights()

    def set_member_weights(self, j: int, weights: list) -> None:
        """Puts `weights` into member j of this group."""
        self.members[j].set_weights(weights)

    def learning_rate_handle(self, j: int, optimizer: Any) -> Any:
        """What sets member j's learning rate (an object with a settable `learning_rate`).

        Args:
            j: the member's position in this group.
            optimizer: the pack's optimizer.
        """
        return self.members[j].optimizer
