"""Agreement between replicas when a pack trains under a `tf.distribute` strategy.

Under `MirroredStrategy` or `MultiWorkerMirroredStrategy` every replica runs the pack's step
on its share of the batch. Whatever decides what a member does (is it frozen, does it have
data, does its update apply) must be decided the same way on every replica, or the replicas'
copies of the members drift apart and their collective operations stop matching. The helpers
here make such decisions from all replicas' values, and run the members' updates (which
synchronise replicas) only where every replica takes the same branch.

On other backends, and on TensorFlow outside a strategy, they reduce to the plain,
single-replica case. `collective_clash_explained` turns TensorFlow's opaque error when two
strategies' all-reduces clash into one that says what happened and how to avoid it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from keras import ops

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND


def replica_context() -> Any:
    """The `tf.distribute` replica context of a step under a strategy, else `None`."""
    if not BACKEND.distribute_strategies:
        return None
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    return tf.distribute.get_replica_context()


def any_replica(flags: Any) -> Any:
    """Element-wise: whether `flags` (booleans) is true on at least one replica."""
    return ops.greater(all_replicas_sum(ops.cast(flags, "float32")), 0.0)


def all_replicas_sum(values: Any) -> Any:
    """`values` summed over the replicas (unchanged without a strategy)."""
    context = replica_context()
    if context is None:
        return values
    return context.all_reduce("sum", values)


def multi_worker_logs(logs: dict) -> dict:
    """The step's logs, shaped so that Keras can average them over several workers.

    Under `MultiWorkerMirroredStrategy` Keras averages each log over all replicas with
    `strategy.reduce("MEAN", value, axis=0)`, which fails for a scalar; a one-element
    vector gives the same mean, as a scalar, on every worker (and a `(1, k)` stacked figure
    its `(k,)` mean). Elsewhere nothing changes.
    """
    context = replica_context()
    if context is None or not _upstream.in_multi_worker_mode(context.strategy):
        return logs
    return {key: ops.expand_dims(value, 0) for key, value in logs.items()}


def run_where(
    conditions: Sequence[Any], functions: Sequence[Callable[..., Any]], args: Sequence[tuple]
) -> None:
    """Calls `functions[i](*args[i])` on every replica where `conditions[i]` holds.

    The functions may synchronise replicas (a Keras optimizer's `apply` all-reduces the
    gradients). `conditions` must be the same on every replica (see `any_replica`); `args`
    may differ per replica.
    """
    import tensorflow as tf

    def skip() -> None:
        return None

    if _upstream.strategy_supports_no_merge_call():
        for condition, function, arguments in zip(conditions, functions, args):
            tf.cond(condition, lambda f=function, a=arguments: _call(f, a), skip)
        return

    def cross_replica(strategy: Any, conditions: Any, args: Any) -> None:
        # A condition is the same on every replica; take the first replica's copy.
        conditions = strategy.experimental_local_results(conditions)[0]
        for condition, function, arguments in zip(conditions, functions, args):
            tf.cond(
                condition,
                lambda f=function, a=arguments: strategy.extended.call_for_each_replica(
                    lambda *values, f=f: _call(f, values), args=a
                ),
                skip,
            )

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(list(conditions), [tuple(a) for a in args])
    )


def _call(function: Callable[..., Any], args: Sequence) -> None:
    function(*args)


_CLASH = re.compile(r"Shape mismatch in the collective instance[^\n]*")


@contextlib.contextmanager
def collective_clash_explained() -> Iterator[None]:
    """Re-raises TensorFlow's "Shape mismatch in the collective instance" with its cause.

    On CPU devices a `MirroredStrategy`'s default all-reduce (`CollectiveAllReduce`)
    restarts its collective keys with every new strategy, so a second strategy over the same
    devices in one process (a notebook) mixes up its all-reduces with the first one's, for
    any Keras model. The error keeps TensorFlow's type where it can (a `RuntimeError`
    otherwise), chained to TensorFlow's own.
    """
    try:
        yield
    except Exception as error:
        found = _CLASH.search(str(error))
        if found is None:
            raise
        message = (
            "Training under `tf.distribute.MirroredStrategy` failed because the collective "
            "all-reduces of two strategies clashed: a second `MirroredStrategy` over the same "
            "devices was created in this process, and on CPUs each new strategy's default "
            "all-reduce (`CollectiveAllReduce`) reuses the first one's collective keys "
            "(plain Keras models fail the same way). Either create one strategy per process "
            "(restart the process: TensorFlow cannot reset its collectives), or give each "
            "strategy a reduction without collectives: `tf.distribute.MirroredStrategy("
            "devices, cross_device_ops=tf.distribute.ReductionToOneDevice())`. See "
            f'docs/scaling.md. TensorFlow reported: "{found.group(0).strip()}"'
        )
        raise _same_kind(error, message) from error


def _same_kind(error: Exception, message: str) -> Exception:
    """An exception of `error`'s type with `message` where TensorFlow's can be built, else a
    `RuntimeError`."""
    if BACKEND.distribute_strategies:
        import tensorflow as tf

        if isinstance(error, tf.errors.OpError) and type(error) is not tf.errors.OpError:
            return type(error)(error.node_def, error.op, message)
    return RuntimeError(message)
