"""`MemberEarlyStopping`: Keras's early stopping for each member of a `ModelPack` on its own."""

from __future__ import annotations

import keras

from keras_gpushare.pack._loop._member_callbacks import PerMember, named_member


class MemberEarlyStopping(PerMember):
    """Stops each member of a `ModelPack` when its own monitored figure stops improving.

    Each member runs its own copy of `keras.callbacks.EarlyStopping`, exactly as it would
    in a fit of its own: `monitor` names a figure as for one model (`"val_loss"`,
    `"val_accuracy"`) and member `i` is judged on its own (`val_m{i}_loss`), with Keras's
    rules for `patience`, `min_delta`, `baseline`, `start_from_epoch`, the direction of a
    metric (`mode="auto"`: losses fall, `accuracy` or `r2_score` rise) and
    `restore_best_weights`. A stopped member keeps its weights and costs no computation from
    the next step on; `fit` ends when no member is left training.

    A plain `keras.callbacks.EarlyStopping(monitor="val_loss")` passed to a pack's `fit`
    behaves the same way; this class names the intent and exposes the per-member results.

    Args:
        monitor: figure to watch, as for a single model. Defaults to `"val_loss"`.
        min_delta: smallest change that counts as an improvement. Defaults to `0`.
        patience: epochs without improvement before a member stops. Defaults to `0`.
        verbose: print a line when a member stops or its best weights are restored.
            Defaults to `0`.
        mode: `"min"`, `"max"` or `"auto"` (Keras's rule). Defaults to `"auto"`.
        baseline: a value a member must beat, or `None`. Defaults to `None`.
        restore_best_weights: give each member the weights of its best epoch at the end of
            training. Defaults to `False`.
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
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        if named_member(monitor) is not None:
            raise ValueError(
                f"Invalid value for argument `monitor`: got {monitor!r}, one member's figure. "
                "MemberEarlyStopping judges every member on its own figure: pass the "
                'single-model name (e.g. "val_loss"), or use keras.callbacks.EarlyStopping '
                f'(monitor="{monitor}") to stop the whole pack on this member.'
            )
        super().__init__(
            keras.callbacks.EarlyStopping(
                monitor=monitor,
                min_delta=min_delta,
                patience=patience,
                verbose=verbose,
                mode=mode,
                baseline=baseline,
                restore_best_weights=restore_best_weights,
                start_from_epoch=start_from_epoch,
            )
        )
        self.monitor = monitor

    @property
    def stopped_epoch(self) -> list[int | None]:
        """For each member, the epoch (0-based) in which it stopped, or `None`."""
        return [c.stopped_epoch if c.stopped_epoch > 0 else None for c in self.copies]

    @property
    def best(self) -> list[float | None]:
        """For each member, the best value of the monitored figure seen."""
        return [None if c.best is None else float(c.best) for c in self.copies]

    @property
    def best_epoch(self) -> list[int]:
        """For each member, the epoch (0-based) of its best value."""
        return [c.best_epoch for c in self.copies]
