"""An internal callback that reports member status changes and ends `fit` when none trains."""

from __future__ import annotations

import logging

import keras

from keras_gpushare.pack.members import ACTIVE, FROZEN_NAN

logger = logging.getLogger("keras_gpushare.pack")


class StatusWatcher(keras.callbacks.Callback):
    """Logs each member frozen for non-finite values once, and stops `fit` when none is active."""

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._seen = list(self.model.status)

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
            logger.warning("ModelPack: no member is training any more; ending fit.")
            self.model.stop_training = True
