"""A pack's first steps traced with Python's collector sparing the objects that already exist.

Tracing a pack's step makes many short-lived Python objects, and each of Python's full
collections then walks every object alive: with 64 member models built, about 0.4 s of the
pack's one-time cost on a 2-core CPU (1.8-1.9 s with the collector as it is, 1.4-1.5 s
with those objects frozen; `benchmarks/one_time_cost.py`). `gc.freeze` moves the objects
that exist to a generation the collector skips until `gc.unfreeze`; objects made meanwhile
are collected as usual, and the frozen ones are collected again once unfrozen. Nothing is
frozen when the collector is off or something else froze objects (a server freezing before
it forks, say): the user's own use of `gc` comes first.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import keras

logger = logging.getLogger("keras_gpushare.pack")


class OldObjectsFrozen:
    """Freezes the objects alive on entry until `release` or the end of the block.

    Args:
        wanted: whether to freeze at all (a pack freezes for its functions' first calls,
            which trace). Defaults to `True`.
    """

    def __init__(self, wanted: bool = True) -> None:
        self.wanted = wanted
        self._frozen = False

    def __enter__(self) -> OldObjectsFrozen:
        if self.wanted and gc.isenabled() and gc.get_freeze_count() == 0:
            gc.freeze()
            self._frozen = True
            if logger.isEnabledFor(logging.DEBUG):
                # Counting walks every frozen object (20 ms with Keras and JAX loaded).
                logger.debug("Froze %d objects while the pack traces.", gc.get_freeze_count())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def release(self) -> None:
        """Unfreezes what `__enter__` froze, once."""
        if self._frozen:
            self._frozen = False
            gc.unfreeze()

    def callback(self) -> keras.callbacks.Callback:
        """A callback that releases at the first epoch's end (the steps are traced by then,
        validation's too), so a long `fit` keeps the collector as it was."""
        return _ReleaseAtEpochEnd(self)


class _ReleaseAtEpochEnd(keras.callbacks.Callback):
    def __init__(self, frozen: OldObjectsFrozen) -> None:
        super().__init__()
        self.frozen = frozen

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.frozen.release()
