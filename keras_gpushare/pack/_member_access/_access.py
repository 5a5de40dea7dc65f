"""A pack's per-member surface, mixed into `ModelPack` as Keras mixes its trainer into
`keras.Model`.

Everything outside the pack that acts on one member goes through these methods: reading and
refreshing the member models, their weights and learning rates, their status, and the slot
operations (`load_member`, `reset_member`, `stop_member`); `summary()` and `count_params()`
show the members as N separate models (`_summary`). The pack provides `_engines` (its
engines), `_members` (the member models), `_status` (the member status variable),
`optimizer`, `compiled` and `name`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from keras_gpushare.pack import _slots
from keras_gpushare.pack import members as members_lib
from keras_gpushare.pack._loop import _fit_args
from keras_gpushare.pack._member_access._summary import member_params, member_places, pack_summary
from keras_gpushare.pack._status import ACTIVE, STATUS_NAMES, STOPPED_EARLY
from keras_gpushare.pack.engines.base import Engine
from keras_gpushare.pack.fusion import VectorizedOptimizer

if TYPE_CHECKING:
    # Mixed into `ModelPack`, before `keras.Model`: the pack's attributes are Keras's too.
    from keras import Model as _Model
else:
    _Model = object


class MemberAccess(_Model):
    """The per-member methods and properties of a `ModelPack` (see the module docstring)."""

    if TYPE_CHECKING:
        _engines: _fit_args.Items[Engine]
        _members: Sequence[keras.Model]
        _status: keras.Variable

    @property
    def members(self) -> list[keras.Model]:
        """The member models, holding the pack's current weights and optimizer state.

        Members the graph engine trains are the models themselves; fused members are
        refreshed from the stacked weights (and optimizer state) each time this is read
        (`refresh_members`).
        """
        return self.refresh_members(optimizer_state=True)

    def refresh_members(self, optimizer_state: bool = True) -> list[keras.Model]:
        """Makes the member models hold the pack's current weights, and returns them.

        A member the graph engine trains is the model itself; a fused member's model is
        refreshed from the stacked weights. The models are the pack's own, not copies
        (`member(i)` makes a standalone copy): a callback that reads them at each epoch's
        end sees that epoch's weights.

        Args:
            optimizer_state: also copy each member's optimizer state (step count, slots)
                into its model's optimizer, which costs a copy of every slot. Defaults to
                `True`.

        Returns:
            The member models, in member order.
        """
        optimizer = getattr(self, "optimizer", None) if optimizer_state else None
        for engine in self._engines:
            engine.sync_members(optimizer)
        return list(self._members)

    def member_model(self, index: int) -> keras.Model:
        """The model in member `index`'s place, as it is: not refreshed, not a copy.

        Its configuration (name, layers, loss and metrics) is the member's; on a fused
        member its weights are the pack's only after `refresh_members()` (or `members`).

        Args:
            index: the member.
        """
        self._check_index(index)
        return self._members[index]

    @property
    def status(self) -> list[str]:
        """Each member's state: `"active"`, `"frozen:nan"`, `"stopped:early"`, `"failed"`."""
        codes = keras.ops.convert_to_numpy(self._status.value)
        return [STATUS_NAMES[int(c)] for c in codes]

    def _active_members(self) -> Any:
        """Whether each member is still training (status `"active"`): a boolean tensor the
        step reads."""
        return keras.ops.equal(keras.ops.convert_to_tensor(self._status), ACTIVE)

    def count_params(self) -> int:
        """The members' own parameters, as N separate models hold them.

        The fused engine's stacked weights hold more (members padded to the widest), which
        `summary()` shows; a layer two members share is counted once.
        """
        return member_params(self._members)

    def summary(
        self,
        line_length: int | None = None,
        positions: Sequence[float] | None = None,
        print_fn: Callable[..., Any] | None = None,
        expand_nested: bool = False,
        show_trainable: bool = False,
        layer_range: Sequence[str] | None = None,
    ) -> None:
        """Prints one row per member: its model, where it trains, output shape, parameters,
        optimizer and status; with `expand_nested=True`, each member's own `summary()` after
        it (given the other arguments, as `keras.Model.summary` takes them)."""
        pack_summary(
            self.name,
            self.members,
            member_places(list(self._engines), len(self._members)),
            self.status,
            stored=member_params([self], trainable=True),
            print_fn=print_fn,
            expand_nested=expand_nested,
            line_length=line_length,
            positions=positions,
            show_trainable=show_trainable,
            layer_range=layer_range,
        )

    def member(self, index: int) -> keras.Model:
        """Returns a standalone copy of member `index`: weights, compile settings, optimizer state.

        The copy shares nothing with the pack and can be saved with `.save("m.keras")`.
        """
        self._check_index(index)
        return members_lib.standalone_copy(self.members[index])

    def stop_member(self, index: int) -> None:
        """Stops training member `index` (its weights stay as they are now)."""
        self._set_member_status(index, STOPPED_EARLY)

    def load_member(self, index: int, model: keras.Model) -> None:
        """Loads `model` into member `index`, which then trains as `model` would from now.

        The member takes `model`'s weights and learning rate, a fresh optimizer state (step
        count, slots, loss scale), zeroed metrics and the status `"active"`; the pack's
        compiled step is kept, so the next `fit` (or the next epoch, when called from a
        callback) starts at once. `model` must match the member but for its values: the
        same layers and settings, loss and metrics, and optimizer but for its learning
        rate. `model` itself is not trained: read the result with `pack.member(index)`.

        Args:
            index: the member.
            model: a built, compiled `keras.Model` whose optimizer has not taken a step.

        Raises:
            ValueError: `model` differs from the member (the message says where), or its
                optimizer has state that loading would drop.
        """
        problem = self.load_problem(index, model)
        if problem is not None:
            raise ValueError(
                f"Cannot load model `{model.name}` into member {index} of ModelPack "
                f"{self.name}: {problem}. A loaded model may differ from the member only in "
                "its values (weights and learning rate); build a new ModelPack for others."
            )
        engine, j = self._locate(index)
        engine.load_member(j, model, self.optimizer)
        members = list(self._members)
        members[index] = engine.occupant(j)
        self._members = _fit_args.Items(members)
        self._set_member_status(index, ACTIVE)

    def load_problem(self, index: int, model: keras.Model) -> str | None:
        """Why `load_member(index, model)` would refuse `model`, or `None` when it loads.

        Raises:
            TypeError: `model` is not a `keras.Model`.
            ValueError: `index` is not a member, or the pack is not compiled.
        """
        self._check_index(index)
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"Invalid value for argument `model`: expected a `keras.Model`, got "
                f"{type(model).__name__}."
            )
        if not self.compiled:
            raise ValueError(
                "This ModelPack is not compiled: `load_member` keeps a compiled pack's step. "
                "Compile the pack first, or pass the model to `ModelPack([...])`."
            )
        if not model.built:
            return "it is not built; call it on data or `build` it"
        engine, j = self._locate(index)
        problem = engine.load_problem(j, model, self.optimizer)
        steps = _slots.steps_taken(model.optimizer)
        if problem is None and steps:
            problem = (
                f"its optimizer has taken {steps} steps, and loading starts the member's "
                "optimizer afresh; recompile the model, or build a new `ModelPack([...])`, "
                "which carries an optimizer's state"
            )
        return problem

    def reset_member(self, index: int) -> None:
        """Restarts member `index`'s optimizer and metrics, keeping its weights.

        Its step count, optimizer slots, loss scale and metrics start again as after
        `compile`, its learning rate is the one it was compiled (or loaded) with, and its
        status becomes `"active"`.

        Args:
            index: the member.
        """
        self._check_index(index)
        if not self.compiled:
            raise ValueError("This ModelPack is not compiled: compile it before `reset_member`.")
        engine, j = self._locate(index)
        engine.reset_member(j, self.optimizer)
        self._set_member_status(index, ACTIVE)

    def get_member_weights(self, index: int) -> list[np.ndarray]:
        """Member `index`'s weights, in the order of its own `model.get_weights()`.

        Read from where the member trains (a fused group's stacked weights included),
        without refreshing the other members.

        Args:
            index: the member.
        """
        self._check_index(index)
        engine, j = self._locate(index)
        return engine.get_member_weights(j)

    def set_member_weights(self, index: int, weights: Sequence[np.ndarray]) -> None:
        """Puts `weights` into member `index`, as its own `model.set_weights()` takes them.

        The member's optimizer state and status stay as they are (`load_member` loads a
        model afresh).

        Args:
            index: the member.
            weights: the member's weights, in the order of `get_member_weights(index)`.
        """
        self._check_index(index)
        engine, j = self._locate(index)
        engine.set_member_weights(j, list(weights))

    def member_optimizer(self, index: int) -> Any:
        """What reads and sets member `index`'s learning rate, as callbacks use an optimizer.

        Its `learning_rate` is the member's: `ReduceLROnPlateau` or
        `LearningRateScheduler` run on the member set it there. On the graph engine it is
        the member's own optimizer; in a fused group, a handle on the member's rate in the
        pack's vectorized optimizer.

        Args:
            index: the member.
        """
        self._check_index(index)
        engine, j = self._locate(index)
        return engine.learning_rate_handle(j, self.optimizer)

    def _check_index(self, index: int) -> None:
        """Refuses what is not a member's index, as a list index refuses a string; and a
        bool too, which a list would take as 0 or 1."""
        count = len(self._members)
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(
                f"Invalid type for argument `index`: got {index!r} of type "
                f"{type(index).__name__}. Expected an integer from 0 to {count - 1}: the "
                "member's position in the pack (not a bool, a string or a float)."
            )
        if not 0 <= index < count:
            raise ValueError(
                f"Invalid member index {index}: this pack has {count} members (0 to {count - 1})."
            )

    def _locate(self, index: int) -> tuple[Engine, int]:
        """The engine training member `index`, and the member's position in it."""
        for engine in self._engines:
            if index in engine.member_ids:
                return engine, engine.member_ids.index(index)
        raise ValueError(f"Invalid member index {index}.")

    def _set_member_status(self, index: int, code: int) -> None:
        self._check_index(index)
        codes = keras.ops.convert_to_numpy(self._status.value).copy()
        codes[index] = code
        self._status.assign(codes)
        self._sync_member_mask()

    def _sync_member_mask(self) -> None:
        """The vectorized optimizer updates exactly the members whose status is active.

        With `on_nan="ignore"` it applies non-finite steps as Keras does, so it can no longer
        tell a stopped member by its (deliberately non-finite) gradients.
        """
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, VectorizedOptimizer):
            codes = keras.ops.convert_to_numpy(self._status.value)
            optimizer.member_mask.assign((codes == ACTIVE).astype("float32"))
