"""An internal callback that reports member status changes and ends `fit` when none trains."""

from __future__ import annotations

import logging
import re

import keras

from keras_gpushare.pack.members import ACTIVE, FROZEN_NAN

logger = logging.getLogger("keras_gpushare.pack")


_MEMBER_KEY = re.compile(r"^(?:val_)?m(\d+)_(.+)$")


class StatusWatcher(keras.callbacks.Callback):
    """Logs each member frozen for non-finite values once, and stops `fit` when none is active.

    It also tells Keras's monitoring callbacks (`EarlyStopping`, `ModelCheckpoint`, ...)
    given `monitor="val_m2_loss"` and `mode="auto"` which way the member's figure improves,
    as Keras does for a single model's `"val_loss"`.
    """

    def __init__(self, callbacks: list) -> None:
        super().__init__()
        self._callbacks = callbacks

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._seen = list(self.model.status)
        for callback in self._callbacks:
            if getattr(callback, "monitor_op", "absent") is None and callback.mode == "auto":
                mode = _member_monitor_mode(self.model, callback.monitor)
                if mode is not None and hasattr(callback, "_set_monitor_op"):
                    callback.mode = mode
                    callback._set_monitor_op()
                    callback.mode = "auto"

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        status = self.model.status
        codes = keras.ops.convert_to_numpy(self.model._status.value)
        for i, (before, now) in enumerate(zip(self._seen, status)):
            if before != now and codes[i] == FROZEN_NAN:
                logger.warning(
                    "ModelPack member %d (%s) frozen in epoch %d: its loss or gradients were "
                    "not finite. Its weights are the last finite ones; the other members go on.",
                    i,
                    self.model._members[i].name,
                    epoch + 1,
                )
        self._seen = status
        if not any(c == ACTIVE for c in codes):
            if any(c == FROZEN_NAN for c in codes):
                logger.warning(
                    "ModelPack: no member is training any more (%s); ending fit.",
                    ", ".join(status),
                )
            else:
                logger.info("ModelPack: every member has stopped; ending fit.")
            self.model.stop_training = True


def _member_monitor_mode(pack: keras.Model, monitor: str) -> str | None:
    match = _MEMBER_KEY.match(monitor)
    if not match or int(match.group(1)) >= len(pack._members):
        return None
    name = match.group(2)
    if name == "loss" or name.endswith("_loss"):
        return "min"
    member = pack._members[int(match.group(1))]
    for container in member.metrics:
        for metric in getattr(container, "metrics", [container]):
            if metric.name == name and hasattr(metric, "_direction"):
                return "max" if metric._direction == "up" else "min"
    return None
