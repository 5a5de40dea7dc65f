"""Refusal of `tf.distribute` strategies: a placed model chooses its own devices.

A strategy decides where variables live and where each replica's ops run; a placed model
decides both per stage. They do not combine. Under a multi-replica strategy every replica
would run every stage on the same stage devices, while the weights are mirrored onto the
replicas' devices instead of the stages'. Under a single-replica strategy every variable
is created on the strategy's one device, so the numbers come out right but the placement,
and the memory it splits, is silently lost. Every entry point checks before any work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from keras_gpushare import _upstream

# Public names, most specific first (MultiWorkerMirroredStrategy's class is called
# CollectiveAllReduceStrategy).
_PUBLIC_NAMES = (
    "MultiWorkerMirroredStrategy",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "TPUStrategy",
)


def _strategy_name(strategy: Any) -> str:
    """The public name of a strategy's class, such as `tf.distribute.MirroredStrategy`."""
    for name in _PUBLIC_NAMES:
        cls = getattr(tf.distribute, name, None)
        if cls is not None and isinstance(strategy, cls):
            return f"tf.distribute.{name}"
    return type(strategy).__name__


def check_no_strategy(action: str, devices: Sequence[str] | None = None) -> None:
    """Raises a `ValueError` if a `tf.distribute` strategy other than the default is active.

    Args:
        action: What the user is doing, for the message, such as "fitting a `PlacedModel`".
        devices: The stage devices, when known. Defaults to `None`.
    """
    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    own = ["/" + d.split("device:")[-1] for d in getattr(strategy.extended, "worker_devices", ())]
    stages = f" {list(devices)}" if devices else ""
    if replicas > 1:
        why = (
            f"A placed model's stages put their ops on their own devices{stages}, so every "
            "replica would run every stage on those same devices, and the strategy would "
            "mirror the weights onto the replicas' devices instead."
        )
    else:
        why = (
            "The strategy creates every variable on its one device, so the stages' weights "
            f"and optimizer slots would sit there instead of on the stage devices{stages}: "
            "the same numbers, but no placement and no memory split."
        )
    raise ValueError(
        f"Invalid use of a placed model under `{_strategy_name(strategy)}` ({replicas} "
        f"replica{'s' if replicas > 1 else ''} on {own}): {action} inside `strategy.scope()` "
        f"is not supported. {why} Build, compile and fit a placed model outside any strategy "
        "scope. For data parallelism, train an unplaced model (or a `kg.ModelPack`) under "
        "the strategy; on several machines, run one `PlacedModel` per machine without a "
        "strategy. See 'Under tf.distribute strategies' in docs/placement.md."
    )


def check_optimizer(optimizer: Any) -> None:
    """Raises a `ValueError` if `optimizer` was created inside a strategy's scope.

    Keras's TensorFlow optimizer keeps the strategy it was created under and creates its
    slots through it, which fails for a placed model's plain per-stage variables.

    Args:
        optimizer: The `optimizer` argument of `compile`: an optimizer, or anything else
            (a name), which is left alone.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        strategy = _upstream.optimizer_strategy(opt)
        if strategy is not None and strategy is not tf.distribute.get_strategy():
            raise ValueError(
                f"Invalid value for argument `optimizer`: {type(opt).__name__} was created "
                f"inside the scope of `{_strategy_name(strategy)}`, and a placed model does "
                "not run under a tf.distribute strategy. Create the optimizer outside any "
                "strategy scope, or pass its name (e.g. optimizer='adam'). See 'Under "
                "tf.distribute strategies' in docs/placement.md."
            )
