"""How a pack's step compiles: batches per compiled call and XLA, from its engines.

`pack.compile(steps_per_execution="auto", jit_compile="auto")` asks the pack's engines what
pays: the least number of batches per call any of them asks for, and XLA where every
gradient engine's group gains from it (`JitPolicy` decides when, on a TensorFlow CPU). A
`tf.distribute` strategy runs one step per call and no XLA.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack._compiling._jit_policy import JitPolicy
from keras_gpushare.pack.engines.base import Engine, GradientEngine, SteppingEngine


def distributed(model: keras.Model) -> bool:
    """Whether `model` trains under a `tf.distribute` strategy."""
    if not BACKEND.distribute_strategies:
        return False
    import tensorflow as tf

    return tf.distribute.has_strategy() or _upstream.model_strategy(model) is not None


def steps_per_execution(
    given: int | str, is_distributed: bool, engines: Sequence[Engine]
) -> int | str:
    """The batches per compiled call for `compile(steps_per_execution=given)`.

    `"auto"` is the least any of `engines` asks for; one under a strategy, and on torch,
    whose Keras trainer runs one batch per call.

    Args:
        given: the argument `compile` received.
        is_distributed: whether the pack trains under a `tf.distribute` strategy.
        engines: the pack's engines.
    """
    if given == "auto":
        if is_distributed or BACKEND.one_batch_per_call:
            return 1
        return min(engine.default_steps_per_execution for engine in engines)
    if is_distributed and given != 1:
        raise ValueError(
            f"Invalid value for argument `steps_per_execution`: got {given!r} "
            "under a tf.distribute strategy. Keras's multi-step loop fails under "
            "MirroredStrategy (keras-team/keras#19246), so a pack under a strategy runs one "
            'step per call: pass steps_per_execution=1 or "auto".'
        )
    return given


def jit_compile(
    given: bool | str, run_eagerly: bool, is_distributed: bool, engines: Sequence[Engine]
) -> tuple[bool | str, JitPolicy | None]:
    """The `jit_compile` Keras compiles with, and the policy that may turn XLA on later.

    `"auto"` on a pack with no stepping engine asks a `JitPolicy` whether XLA pays for every
    gradient engine's group (each engine's rule); otherwise `given` goes to Keras as it is.

    Args:
        given: the argument `compile` received.
        run_eagerly: whether the steps run eagerly.
        is_distributed: whether the pack trains under a `tf.distribute` strategy.
        engines: the pack's engines.
    """
    stepping_engines = [e for e in engines if isinstance(e, SteppingEngine)]
    if given != "auto" or stepping_engines:
        return given, None
    gradient_engines = [e for e in engines if isinstance(e, GradientEngine)]
    supported = (
        not run_eagerly
        and not is_distributed
        and all(engine.supports_jit() for engine in gradient_engines)
    )
    policy = JitPolicy.for_pack(supported)
    return policy.initial, policy
