"""`MemberEarlyStopping`: early stopping for each member of a `ModelPack` on its own."""

from __future__ import annotations

import logging
from typing import Any

import keras
import numpy as np

from keras_gpushare.pack.members import ACTIVE

logger = logging.getLogger("keras_gpushare.pack")


def member_key(monitor: str, index: int) -> str:
    """The log key of `monitor` for member `index`: `val_loss` -> `val_m3_loss`."""
    if monitor.startswith("val_"):
        return f"val_m{index}_{monitor[4:]}"
    return f"m{index}_{monitor}"


class MemberEarlyStopping(keras.callbacks.Callback):
    """Stops each member of a `ModelPack` when its own monitored figure stops improving.

    `monitor` names a figure as for one model (`"val_loss"`, `"val_accuracy"`); member `i` is
    judged on its own log key (`val_m{i}_loss`). A stopped member keeps its weights (or its best
    ones) and costs no gradient computation from the next step on; `fit` ends when no member is
    left training.

    Args:
        monitor: figure to watch, as for a single model. Defaults to `"val_loss"`.
        min_delta: smallest change that counts as an improvement. Defaults to `0`.
        patience: epochs without improvement before a member stops. Defaults to `0`.
        mode: `"min"`, `"max"` or `"auto"` (from the figure's name). Defaults to `"auto"`.
        baseline: a value a member must beat, or `None`. Defaults to `None`.
        restore_best_weights: give each member the weights of its best epoch when it stops,
            and at the end of training. Defaults to `False`.
        start_from_epoch: epochs to wait before judging. Defaults to `0`.

    Example:

    ```python
    import numpy as np
    import keras
    import keras_gpushare as kg

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])

    pack = kg.ModelPack.from_builder(build, n=3)
    pack.compile(optimizer=[keras.optimizers.SGD(lr) for lr in (1e-4, 1e-2, 1e-1)], loss="mse")
    x = np.random.rand(128, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    stop = kg.callbacks.MemberEarlyStopping(monitor="val_loss", patience=1)
    pack.fit(x, y, validation_split=0.25, epochs=5, callbacks=[stop], verbose=0)
    print(pack.status, stop.stopped_epoch)
    ```
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        super().__init__()
        if mode not in ("auto", "min", "max"):
            raise ValueError(
                f'Invalid value for argument `mode`: got {mode!r}. Expected "auto", "min" or "max".'
            )
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.mode = mode
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch

    def _better(self, value: float, reference: float) -> bool:
        if self._maximize:
            return value - self.min_delta > reference
        return value + self.min_delta < reference

    def on_train_begin(self, logs: dict | None = None) -> None:
        from keras_gpushare.pack.model import ModelPack

        if not isinstance(self.model, ModelPack):
            raise TypeError(
                "MemberEarlyStopping works on a ModelPack; for a single model use "
                "keras.callbacks.EarlyStopping."
            )
        n = len(self.model._members)
        name = self.monitor.removeprefix("val_")
        self._maximize = self.mode == "max" or (
            self.mode == "auto" and any(k in name for k in ("acc", "auc", "precision", "recall"))
        )
        self.wait = [0] * n
        self.best = [self.baseline] * n
        self.best_weights: list[Any] = [None] * n
        self.stopped_epoch: list[int | None] = [None] * n
        self._warned = False

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        pack = self.model
        for i, state in enumerate(pack.status):
            if state != "active" or epoch < self.start_from_epoch:
                continue
            key = member_key(self.monitor, i)
            value = logs.get(key)
            if value is None:
                self._warn_missing(key, logs)
                continue
            value = float(value)
            if np.isfinite(value) and (self.best[i] is None or self._better(value, self.best[i])):
                self.best[i] = value
                self.wait[i] = 0
                if self.restore_best_weights:
                    self.best_weights[i] = pack._get_member_weights(i)
                continue
            self.wait[i] += 1
            if self.wait[i] >= self.patience and epoch > 0:
                self._stop(i, epoch)
        if not any(s == "active" for s in pack.status):
            pack.stop_training = True

    def _stop(self, index: int, epoch: int) -> None:
        self.stopped_epoch[index] = epoch
        self.model.stop_member(index)
        if self.restore_best_weights and self.best_weights[index] is not None:
            self.model._set_member_weights(index, self.best_weights[index])
        logger.info("Member %d stopped early at epoch %d.", index, epoch + 1)

    def on_train_end(self, logs: dict | None = None) -> None:
        if not self.restore_best_weights:
            return
        codes = keras.ops.convert_to_numpy(self.model._status.value)
        for i, weights in enumerate(self.best_weights):
            if weights is not None and codes[i] == ACTIVE:
                self.model._set_member_weights(i, weights)

    def _warn_missing(self, key: str, logs: dict) -> None:
        if not self._warned:
            logger.warning(
                "MemberEarlyStopping: %r is not in the logs (available: %s); members are not "
                "stopped on it.",
                key,
                ", ".join(sorted(logs)),
            )
            self._warned = True
