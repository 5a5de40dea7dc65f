"""An internal callback that reports member status changes and ends `fit` when none trains."""

from __future__ import annotations

import logging
import warnings

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack._loop._member_callbacks import metric_direction, named_member
from keras_gpushare.pack._loop._pack_internals import PackInternals
from keras_gpushare.pack._status import ACTIVE, FROZEN_NAN, STATUS_NAMES

logger = logging.getLogger("keras_gpushare.pack")


class StatusWatcher(keras.callbacks.Callback):
    """Warns once per member frozen for non-finite values, and stops `fit` when none is active.

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
                if mode is not None:
                    callback.mode = mode
                    _upstream.reset_monitor_op(callback)
                    callback.mode = "auto"

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        status = self.model.status
        for i, (before, now) in enumerate(zip(self._seen, status)):
            if before != now and now == STATUS_NAMES[FROZEN_NAN]:
                message = (
                    f"ModelPack member {i} ({self.model.member_model(i).name}) was frozen in epoch "
                    f"{epoch + 1}: its loss or gradients were not finite (labels out of range "
                    "for its loss, a learning rate too high, ...). Its weights are the last "
                    "finite ones; the other members go on. Pass on_nan='ignore' to apply "
                    "non-finite updates as plain fit does."
                )
                logger.warning(message)
                warnings.warn(message, stacklevel=2)
        self._seen = status
        if STATUS_NAMES[ACTIVE] not in status:
            if STATUS_NAMES[FROZEN_NAN] in status:
                logger.warning(
                    "ModelPack: no member is training any more (%s); ending fit.",
                    ", ".join(status),
                )
            else:
                logger.info("ModelPack: every member has stopped; ending fit.")
            self.model.stop_training = True


def _member_monitor_mode(pack: PackInternals, monitor: str) -> str | None:
    named = named_member(monitor)
    if named is None or named[0] >= len(pack.status):
        return None
    return metric_direction(pack.member_model(named[0]), named[1])
