"""The progress bar of a pack's `fit`, `evaluate` and `predict`: plain Keras's, readable at N.

Keras's `ProgbarLogger` prints every figure of the logs on one line, in the order the step
returns them, and counts `batch + 1` batches when a batch hook is called. For a pack that
gives lines of a thousand characters at 16 members, members in string order (TensorFlow
and JAX sort a step's dict of results by key: m0, m10, m11, ..., m1), and, under
`steps_per_execution="auto"` (64 batches a call), `64/16` in the middle of an epoch of 16
batches with a negative ETA. `PackProgbar` is Keras's progress bar with three changes:

- the batch count never exceeds the epoch's batches (`16/16`, as a plain `fit` shows);
- figures are in member order: the pack's `loss`, each member's in numeric order, then the
  same for validation;
- when the first batch's figures would make a line wider than the terminal, the bar shows
  the pack's own figures only (the members' mean `loss`, and those of other callbacks) and
  each epoch (or evaluation) ends with one line per member in Keras's `name: value` form.

`ModelPack` adds it in place of Keras's default bar; a `ProgbarLogger` given by the user is
used as given.
"""

from __future__ import annotations

import shutil
from typing import Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack._loop._member_callbacks import member_logs, named_member

# Keras's bar without figures: "16/16 ━━━━━━━━━━━━━━━━━━━━ 1s 20ms/step".
_BAR_WIDTH = 40


def member_order(logs: dict) -> dict:
    """`logs` with the pack's figures first, then each member's in numeric order, then the
    same for validation figures."""

    def key(item: tuple[int, str]) -> tuple:
        position, name = item
        member = named_member(name)
        return (name.startswith("val_"), -1 if member is None else member[0], position)

    ordered = sorted(enumerate(logs), key=key)
    return {name: logs[name] for _, name in ordered}


def _format(value: Any) -> str:
    """A figure as Keras's progress bar writes it."""
    value = float(value)
    return f"{value:.4f}" if abs(value) > 1e-3 or value == 0 else f"{value:.4e}"


def _line(logs: dict) -> str:
    return " - ".join(f"{name}: {_format(value)}" for name, value in logs.items())


class PackProgbar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar for a pack of `n_members` members (see the module docstring).

    Args:
        n_members: the pack's member count.

    Example:

    ```python
    import keras
    import numpy as np
    from keras_gpushare.pack._loop._progress import PackProgbar

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    x, y = np.zeros((8, 3)), np.zeros((8, 1))
    model.fit(x, y, epochs=1, verbose=1, callbacks=[PackProgbar(n_members=1)])
    ```
    """

    # As Keras's default bar, which `CallbackList` adds after choosing async dispatch.
    async_safe = True

    def __init__(self, n_members: int) -> None:
        super().__init__()
        self.n_members = n_members
        self._wide: bool | None = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._wide = None
        super().on_epoch_begin(epoch, logs)

    def on_test_begin(self, logs: dict | None = None) -> None:
        if not _upstream.progbar_in_fit(self):
            self._wide = None
        super().on_test_begin(logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_end(self._counted(batch), self._shown(logs))

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        super().on_test_batch_end(self._counted(batch), self._shown(logs))

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        super().on_predict_batch_end(self._counted(batch), logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, self._shown(logs))
        self._print_members(logs)

    def on_test_end(self, logs: dict | None = None) -> None:
        if _upstream.progbar_in_fit(self):
            return
        super().on_test_end(self._shown(logs))
        self._print_members(logs)

    def _counted(self, batch: int) -> int:
        """The last batch a call ran, at most the epoch's last (Keras counts whole calls)."""
        return batch if not self.target else min(batch, self.target - 1)

    def _shown(self, logs: dict | None) -> dict:
        """The figures for the bar: all of them in member order, or the pack's own when the
        first batch's line would not fit the terminal (the members' then follow at the end).

        Decided once a bar: Keras's bar keeps showing every figure it was ever given.
        """
        logs = member_order(logs or {})
        if self._wide is None and logs:
            width = shutil.get_terminal_size(fallback=(120, 24)).columns
            self._wide = _BAR_WIDTH + len(_line(logs)) > width
        if not self._wide:
            return logs
        return {name: value for name, value in logs.items() if named_member(name) is None}

    def _print_members(self, logs: dict | None) -> None:
        """One line per member, after the bar, when the bar left the members out."""
        if not (self._wide and self.verbose and logs):
            return
        logs = member_order(logs)
        digits = len(str(self.n_members - 1))
        for i in range(self.n_members):
            figures = member_logs(logs, i)
            if figures:
                _upstream.print_msg(f"  m{i:<{digits}} - {_line(figures)}")
