"""The protocol every engine of a `ModelPack` follows.

An engine trains some of a pack's members (a "group") by one method. The pack builds its
engines (`planner.build_engines`), hands each its members, their positions in the pack
(`member_ids`) and the options it needs, and calls them; an engine never sees the pack. Two
kinds exist, each a base class declaring every method the pack calls on it, and the pack
tells them apart by type:

- `GradientEngine`: its members are updated by the pack's optimizer from the gradient of the
  summed loss. It computes member outputs, losses and metrics, and the pack's Keras training
  step (any backend) does the rest;
- `SteppingEngine`: it updates its members itself inside the pack's step (TensorFlow only):
  `train` runs forward, backward and each member's own optimizer.

Each engine reports its members' figures, which the pack turns into its logs, as one
`GroupFigures`: stacked where the engine keeps them stacked, so the traced step does not
grow by a few operations for every member.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_gpushare.pack import _slots
from keras_gpushare.pack.fusion._transforms import rows_of


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
class StackedRatio:
    """Running means left undivided: each member's `total` and `count`, `(k,)` tensors.

    A figure an engine reports so is divided where the logs are read, outside the step
    (`host_mean`): the step holds no division, comparison or select for it (on a CPU, XLA
    compiles a kernel fewer for each such figure).
    """

    total: Any
    count: Any


def host_mean(total: Any, count: Any) -> np.ndarray:
    """`total / count` in NumPy, NaN where `count` is 0: what a running mean's `result`
    computes in the step (float32 IEEE division either way), read on the host.

    Args:
        total: the members' weighted sums, a NumPy array.
        count: their weights' sums, of the same shape.
    """
    with np.errstate(all="ignore"):  # as XLA: an overflow is inf, without a warning
        mean = total / np.maximum(count, np.asarray(1e-12, dtype=count.dtype))
    return np.where(count > 0, mean, np.asarray(np.nan, dtype=mean.dtype))


@dataclasses.dataclass
class GroupFigures:
    """An engine's members' figures since the metrics were last reset.

    Attributes:
        losses: the members' mean losses in `member_ids` order, a `(k,)` tensor or a
            `StackedRatio`.
        ran: whether each member ran a step since the reset, a `(k,)` boolean tensor;
            `None` where `losses` is a `StackedRatio` (a member ran where its count is
            above 0).
        shared: figures every member has under one key, each a `(k,)` tensor or a
            `StackedRatio` (the fused engine's stacked metrics), by key.
        own: each member's other figures by its own key (`mae`, `price_loss`, ...), a
            dict of scalar tensors per member; logged after the shared ones.
    """

    losses: Any
    ran: Any
    shared: dict
    own: list


class Engine:
    """What every engine of a `ModelPack` does (see the module docstring).

    Subclasses derive from `GradientEngine` or `SteppingEngine`, never from this class
    alone, and set two class attributes: `kind`, the engine's name in `ModelPack.engine`,
    and `default_steps_per_execution`, the batches per compiled call that
    `steps_per_execution="auto"` picks for it (a pack takes the least over its engines).

    Args:
        members: the member models of this group, in `member_ids` order.
        member_ids: each member's position in the pack.
        options: the pack's `EngineOptions`.
    """

    kind = ""
    default_steps_per_execution = 1

    def __init__(
        self, members: Sequence[keras.Model], member_ids: Sequence[int], options: EngineOptions
    ) -> None:
        self.members = list(members)
        self.member_ids = tuple(int(i) for i in member_ids)
        self.options = options
        # Member j's learning rate when it was loaded (`load_member`), which a reset restores.
        self._learning_rates: dict[int, Any] = {}

    def keras_objects(self) -> list:
        """The Keras layers and models the pack tracks for this engine (weights, saving)."""
        raise NotImplementedError

    def member_rows(self, values: Any) -> Any:
        """This engine's members' rows of `values` (one row a pack member), in `member_ids`
        order: `values` itself when the engine holds every member in order, so that the
        step gathers nothing."""
        return rows_of(values, self.member_ids)

    def with_member_rows(self, values: Any, rows: Any) -> Any:
        """`values` (one row a pack member) with this engine's members' rows set to `rows`
        (`member_ids` order), `member_rows`' inverse."""
        if self.member_ids == tuple(range(values.shape[0])):
            return rows
        return ops.scatter_update(values, [[i] for i in self.member_ids], rows)

    @property
    def metrics(self) -> list:
        """The metric objects whose state the pack resets each epoch."""
        raise NotImplementedError

    def configure(self, compile_args: Sequence[dict]) -> None:
        """Prepares for training compiled members (`compile_args[j]`: member j's arguments)."""
        self._learning_rates = {
            j: _slots.fixed_learning_rate(member.optimizer) for j, member in enumerate(self.members)
        }

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

    def figures(self) -> GroupFigures:
        """The members' figures, in `member_ids` order."""
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

    def occupant(self, j: int) -> keras.Model:
        """The model member j's weights are read into and written from (`pack.members`)."""
        return self.members[j]

    def loaded_by_values(self) -> list[int]:
        """The pack positions of members whose model is not the one the engine was built
        from (loaded by values into a fused slot)."""
        return []

    def load_problem(self, j: int, model: keras.Model, optimizer: Any) -> str | None:
        """Why `model` cannot be loaded into member j (`load_member`), or `None`.

        It can when it matches the member but for its values: the same layers and
        settings, loss and metrics, and optimizer but for its learning rate.

        Args:
            j: the member's position in this group.
            model: the model to load.
            optimizer: the pack's optimizer.
        """
        member = self.occupant(j)
        return (
            _slots.structure_difference(member, model)
            or _slots.compile_difference(self.members[j], model)
            or _slots.optimizer_difference(self.members[j].optimizer, model.optimizer)
        )

    def load_member(self, j: int, model: keras.Model, optimizer: Any) -> None:
        """Puts `model`'s weights and learning rate into member j, with a fresh optimizer
        state and zeroed metrics.

        The pack has checked that `model` matches member j but for its values (`_slots`);
        the member's model object stays the one the step was traced with.

        Args:
            j: the member's position in this group.
            model: the model whose values member j takes.
            optimizer: the pack's optimizer.
        """
        self.set_member_weights(j, model.get_weights())
        self._learning_rates[j] = _slots.fixed_learning_rate(model.optimizer)
        self.reset_member(j, optimizer)

    def reset_member(self, j: int, optimizer: Any) -> None:
        """Puts member j's optimizer state back to a new optimizer's and zeroes its metrics.

        Its step count, slots and loss scale restart; its learning rate is the one it was
        compiled or loaded with. Here the member's own optimizer holds that state.

        Args:
            j: the member's position in this group.
            optimizer: the pack's optimizer.
        """
        member = self.members[j]
        rate = self._learning_rates.get(j, _slots.fixed_learning_rate(member.optimizer))
        _slots.reset_optimizer(member.optimizer, member.trainable_variables, rate)
        for metric in member.metrics:
            metric.reset_state()

    def learning_rate_handle(self, j: int, optimizer: Any) -> Any:
        """What sets member j's learning rate (an object with a settable `learning_rate`).

        Args:
            j: the member's position in this group.
            optimizer: the pack's optimizer.
        """
        return self.members[j].optimizer

    def step_notes(self) -> list[str]:
        """What of the members' losses and metrics the step computes member by member, and
        why: lines of `ModelPack.fusion_report` (none but for fused groups)."""
        return []

    def describe(self, index: int) -> str:
        """Where this engine's members train, as the pack's `summary` names it.

        Args:
            index: this engine's position among the pack's engines of its kind.
        """
        raise NotImplementedError


class GradientEngine(Engine):
    """An engine whose members the pack's optimizer updates from the summed loss's gradient.

    The pack's training step calls `call` (training outputs), `loss`, then differentiates
    the sum of the losses with respect to `keras_objects()`' trainable variables and
    applies the pack's (vectorized) optimizer, then `update_metrics`.
    """

    def supports_jit(self) -> bool:
        """Whether XLA pays for this group's step (`jit_compile="auto"`)."""
        raise NotImplementedError

    def loss(
        self, x: Any, y: Any, y_pred: Any, sample_weight: Any, status: Any, training: bool
    ) -> tuple[Any, Any]:
        """This group's member losses to sum, and which members to freeze.

        Args:
            x: the pack's inputs.
            y: the pack's labels.
            y_pred: this group's raw outputs (`call`'s), or its members' outputs.
            sample_weight: the pack's sample weights.
            status: this group's status codes, shape (k,).
            training: whether this is a training step.

        Returns:
            `(losses, freeze)`: the (k,) losses whose sum the pack differentiates, and a
            boolean (k,) vector of the members to freeze.
        """
        raise NotImplementedError

    def update_metrics(self, y: Any, y_pred: Any, sample_weight: Any) -> None:
        """Updates every member's compiled metrics from this group's outputs `y_pred`."""
        raise NotImplementedError

    def build_metric_states(self, y: Any) -> None:
        """Makes the metric state the step would make, before the first step (labels `y`)."""

    def read_optimizer_state(self, optimizer: Any) -> None:
        """Loads the members' own optimizer state (a member trained before) into `optimizer`,
        the pack's optimizer."""


class SteppingEngine(Engine):
    """An engine that updates its members itself in the pack's step (TensorFlow only).

    Its members' variables are not the pack optimizer's: the pack's TensorFlow step
    (`_tf_steps.TensorFlowSteps`) calls `train` and `test` after the gradient engines.
    """

    def train(self, data: Any, status: Any) -> Any:
        """Trains every active member on its part of `data`; returns the new status codes.

        Args:
            data: the pack's batch.
            status: this group's status codes, shape (k,).
        """
        raise NotImplementedError

    def test(self, data: Any) -> None:
        """Evaluates every member on the whole batch `data`, updating its metrics."""
        raise NotImplementedError
