"""Keras callbacks run once per member of a pack, each as if its member trained alone.

In N separate fits, `EarlyStopping(monitor="val_loss")` stops each model on its own
`val_loss`, `ReduceLROnPlateau` lowers each model's rate on its own plateau, and
`LearningRateScheduler` sets each model's rate from its own current rate. `PerMember` gives a
pack the same: it runs one copy of the callback per member, handing each copy a `MemberView`
as its model (that member's weights, optimizer and stop flag) and that member's figures under
single-model names (`val_loss`, not `val_m2_loss`). What a copy writes into its logs comes
back under the member's prefix (`learning_rate` becomes `m2_learning_rate`).

A `TensorBoard` writing weight histograms (`histogram_freq`) writes each member's own weights,
in the member's names and shapes, as N separate fits would (`m/dense/kernel/histogram`), not
the fused engine's stacked weights: `member_weights_tensorboard` points its weight logging at
the members and leaves everything else it writes as it is.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import TYPE_CHECKING, Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack._loop._pack_internals import PackInternals
from keras_gpushare.pack._status import ACTIVE, STATUS_NAMES
from keras_gpushare.pack.members import is_pack

_MEMBER_KEY = re.compile(r"^(?:val_)?m(\d+)_(.+)$")


def member_logs(logs: dict | None, index: int) -> dict:
    """Member `index`'s figures under single-model names: `val_m2_loss` -> `val_loss`."""
    prefix, val_prefix = f"m{index}_", f"val_m{index}_"
    result = {}
    for key, value in (logs or {}).items():
        if key.startswith(prefix):
            result[key[len(prefix) :]] = value
        elif key.startswith(val_prefix):
            result["val_" + key[len(val_prefix) :]] = value
    return result


def pack_key(key: str, index: int) -> str:
    """Member `index`'s log key for a single-model key: `val_loss` -> `val_m{index}_loss`."""
    if key.startswith("val_"):
        return f"val_m{index}_{key[4:]}"
    return f"m{index}_{key}"


def named_member(monitor: str) -> tuple[int, str] | None:
    """`(index, figure)` when `monitor` is one member's figure (`val_m2_loss` -> (2, "loss"))."""
    match = _MEMBER_KEY.match(monitor)
    return None if match is None else (int(match.group(1)), match.group(2))


def metric_direction(member: keras.Model, name: str) -> str | None:
    """`"min"` or `"max"` for a figure of `member`, by Keras's own rule; `None` if unknown.

    Losses are minimised; a metric says which way it improves through its `_direction`
    (so `r2_score`, `f1_score` and `iou` are maximised). This is the rule Keras's
    `EarlyStopping` and `ModelCheckpoint` apply with `mode="auto"`.
    """
    name = name.removeprefix("val_")
    if name == "loss" or name.endswith("_loss"):
        return "min"
    for container in member.metrics:
        for metric in getattr(container, "metrics", [container]):
            direction = _upstream.metric_direction(metric)
            if metric.name == name and direction is not None:
                return "max" if direction == "up" else "min"
    return None


class MemberView:
    """Member `index` of a pack, as a Keras callback acting on one model sees it.

    `get_weights`/`set_weights` read and write the member's weights in the pack (also on the
    fused engine, where the member model is a view of stacked weights); `optimizer` is what
    sets the member's learning rate; setting `stop_training` stops that member only. Other
    attributes are the member model's.

    Args:
        pack: the `ModelPack`.
        index: the member.
    """

    def __init__(self, pack: PackInternals, index: int) -> None:
        self._pack = pack
        self._index = index

    @property
    def stop_training(self) -> bool:
        return self._pack.status[self._index] != "active"

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        if value and self._pack.status[self._index] == "active":
            self._pack.stop_member(self._index)

    @property
    def optimizer(self) -> Any:
        return self._pack.member_optimizer(self._index)

    def get_weights(self) -> list:
        return self._pack.get_member_weights(self._index)

    def set_weights(self, weights: list) -> None:
        self._pack.set_member_weights(self._index, weights)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pack.member_model(self._index), name)


class PerMember(keras.callbacks.Callback):
    """Runs a copy of `callback` for every member of a `ModelPack`, each on its own member.

    A member's copy gets epoch events while the member trains (not after it stopped or was
    frozen before the epoch began) and `on_train_end` once.

    Args:
        callback: a Keras callback written for one model (`EarlyStopping`,
            `ReduceLROnPlateau`, `LearningRateScheduler`, ...); it is copied per member,
            never run itself.
    """

    def __init__(self, callback: keras.callbacks.Callback) -> None:
        super().__init__()
        self.callback = callback
        self.copies: list[keras.callbacks.Callback] = []
        self._running: list[bool] = []

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        if not is_pack(model):
            raise TypeError(
                f"{type(self).__name__} works on a ModelPack; for a single model use "
                f"keras.callbacks.{type(self.callback).__name__}."
            )
        # Shallow copies: a callback used in an earlier fit still refers to that model.
        self.copies = [copy.copy(self.callback) for _ in model.status]
        for i, callback in enumerate(self.copies):
            callback.set_model(MemberView(model, i))

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        for callback in self.copies:
            callback.set_params(params)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._running = [True] * len(self.copies)
        for i, callback in enumerate(self.copies):
            callback.on_train_begin(member_logs(logs, i))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._running = [status == STATUS_NAMES[ACTIVE] for status in self.model.status]
        for i, callback in enumerate(self.copies):
            if self._running[i]:
                callback.on_epoch_begin(epoch, member_logs(logs, i))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        for i, callback in enumerate(self.copies):
            if not self._running[i]:
                continue
            figures = member_logs(logs, i)
            before = dict(figures)
            callback.on_epoch_end(epoch, figures)
            if logs is not None:
                for key, value in figures.items():
                    if key not in before or before[key] is not value:
                        logs[pack_key(key, i)] = value

    def on_train_end(self, logs: dict | None = None) -> None:
        for i, callback in enumerate(self.copies):
            callback.on_train_end(member_logs(logs, i))


class _MemberLayers:
    """A pack as `TensorBoard`'s weight logging reads it: `layers` are the members' own
    layers, in member order; everything else is the pack's.

    Args:
        pack: the `ModelPack`.
        members: its members, holding the pack's current weights.
    """

    def __init__(self, pack: keras.Model, members: list[keras.Model]) -> None:
        self._pack = pack
        self.layers = [layer for member in members for layer in member.layers]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pack, name)


if TYPE_CHECKING:
    from keras.callbacks import TensorBoard as _TensorBoard
else:
    _TensorBoard = object


class _MemberWeights(_TensorBoard):
    """Mixed into a `TensorBoard` class: weight histograms (and images) of the members."""

    def _log_weights(self, epoch: int) -> None:
        pack = self.model
        members = pack.refresh_members(optimizer_state=False)
        _upstream.set_callback_model(self, _MemberLayers(pack, members))
        try:
            _upstream.log_weights(super(), epoch)
        finally:
            _upstream.set_callback_model(self, pack)


@functools.cache
def _member_weights_class(cls: type) -> type:
    """`cls` (`TensorBoard` or a subclass) writing its weight histograms per member."""
    return type(cls.__name__, (_MemberWeights, cls), {"__module__": __name__})


def member_weights_tensorboard(
    callback: keras.callbacks.TensorBoard,
) -> keras.callbacks.TensorBoard:
    """`callback` writing each member's weights where it writes weight histograms.

    Keras writes a histogram for every weight of every layer of the model it is given. For
    a pack on the fused engine that is the stacked weights (all members padded to the
    widest, under the first member's names); the result writes, for every member, what a
    fit of that member alone writes: each weight of each of the member's layers, under its
    own path and in its own shape, holding the member's weights at the end of the epoch
    (and with `write_images`, its images). Scalars, the graph, profiling and embeddings are
    left as Keras writes them for the pack.

    The result shares `callback`'s state (its attributes are the same object), so the
    callback the user holds sees the fit as in plain Keras (its model, writers and batch
    counters).

    Args:
        callback: a `keras.callbacks.TensorBoard` (or subclass) given to a pack's `fit`.

    Returns:
        A `TensorBoard` of `callback`'s class with its weight logging pointed at the members.
    """
    cls: type = type(callback)
    result: keras.callbacks.TensorBoard = object.__new__(_member_weights_class(cls))
    result.__dict__ = callback.__dict__
    return result


def per_member_callbacks(callbacks: list) -> list:
    """`callbacks` with Keras's per-model callbacks run per member (see the module docstring).

    `EarlyStopping` and `ReduceLROnPlateau` watching a figure every member has (`val_loss`)
    and every `LearningRateScheduler` are wrapped in `PerMember`; a monitor that names one
    member's figure (`val_m2_loss`) acts on the whole pack, as Keras runs it. A `TensorBoard`
    writing weight histograms writes them per member (`member_weights_tensorboard`).
    """
    result = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.TensorBoard) and callback.histogram_freq:
            callback = member_weights_tensorboard(callback)
        elif isinstance(callback, keras.callbacks.LearningRateScheduler) or (
            isinstance(callback, (keras.callbacks.EarlyStopping, keras.callbacks.ReduceLROnPlateau))
            and named_member(callback.monitor) is None
        ):
            callback = PerMember(callback)
        result.append(callback)
    return result
