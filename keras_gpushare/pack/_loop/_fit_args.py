"""What `ModelPack.fit`, `evaluate` and `predict` do with their arguments before Keras's.

Keras's own loops run a pack's steps; the pack first reads the arguments Keras will read
(`call_arguments`), checks its members can take the data (`check_inputs`, `check_labels`,
`check_shardable`), picks the batches per compiled call for the callbacks given
(`steps_for`), adds its own callbacks around the user's (`fit_callbacks`) and puts its
own progress bar in Keras's place (`with_progress_bar`). Afterwards it orders `evaluate`'s
figures (`evaluate_values`) and stacks predictions when asked (`stacked_predictions`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

import keras
import numpy as np
from keras import tree

from keras_gpushare import _upstream
from keras_gpushare.pack import _chief
from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack._loop import _batch_calls
from keras_gpushare.pack._loop._member_callbacks import per_member_callbacks
from keras_gpushare.pack._loop._progress import PackProgbar
from keras_gpushare.pack._loop._watcher import StatusWatcher


def call_arguments(method: str, x: Any, y: Any, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call of `keras.Model.<method>` by name, defaults included (the
    defaults alone when Keras would refuse the call: it raises its own error then)."""
    signature = inspect.signature(getattr(keras.Model, method))
    given = (x, *args) if method == "predict" else (x, y, *args)
    try:
        bound = signature.bind_partial(None, *given, **kwargs)
    except TypeError:
        bound = signature.bind_partial(None)
    bound.apply_defaults()
    return dict(bound.arguments)


def needs_a_batch(models: Sequence[keras.Model]) -> bool:
    """Whether building `models` (the pack and its members) needs a batch of data, by
    Keras's own rule for each: one of its layers is not built, or its compiled loss or
    metrics are not.

    Plain `fit` and `evaluate` read a batch to build only then: reading one starts an
    epoch of the data (on torch a `DataLoader` draws its seed from the global generator,
    which changes the order of the next shuffle), so the pack reads one only then too.
    """
    for model in models:
        if not all(layer.built for layer in _upstream.all_layers(model)):
            return True
        compiled = (_upstream.compile_loss(model), _upstream.compile_metrics(model))
        if any(part is not None and not part.built for part in compiled):
            return True
    return False


def check_inputs(x: Any, members: Sequence[keras.Model], engines: Sequence[Any]) -> None:
    """Raises, naming the member, when a member cannot take the inputs `x`.

    A gradient engine's group (a fused group) computes its members from one set of inputs,
    those of its first member; plain Keras gives each model the keys its own inputs are
    named after. A member whose layers fail on the shape of `x` is named before any step
    runs.

    Args:
        x: the inputs given to `fit`, `evaluate` or `predict`.
        members: the pack's members.
        engines: the pack's gradient engines.
    """
    if hasattr(x, "element_spec"):
        spec = x.element_spec
        x = spec[0] if isinstance(spec, tuple) else spec
    data_lib.check_array_data("x", x)
    data_lib.check_member_inputs(x, members)
    if not isinstance(x, dict):
        return
    for engine in engines:
        names = [data_lib.input_names(member) for member in engine.members]
        for member_id, own in zip(engine.member_ids[1:], names[1:]):
            if own != names[0]:
                raise ValueError(
                    f"Invalid inputs: members {engine.member_ids[0]} and {member_id} are "
                    f"fused together but read different keys of the input dict ({names[0]} "
                    f"and {own}). Name the members' `keras.Input`s alike, or pass "
                    "`fuse=False` to ModelPack to train them on the graph engine."
                )


def check_labels(
    x: Any, y: Any, members: Sequence[keras.Model], output_counts: Sequence[int | None]
) -> None:
    """Raises, naming the member, when the labels cannot match the members' outputs.

    Args:
        x: the inputs (a dataset's element spec gives the labels when `y` is None).
        y: the labels.
        members: the pack's members.
        output_counts: each member's number of outputs.
    """
    if y is None and hasattr(x, "element_spec"):
        spec = x.element_spec
        y = spec[1] if isinstance(spec, tuple) and len(spec) > 1 else None
    data_lib.check_array_data("y", y)
    per_member = data_lib.labels_per_member(y, output_counts)
    data_lib.check_member_labels(x, y, members, per_member)
    if BACKEND.label_ranges_checked:
        # As Keras on TensorFlow does; on JAX and torch plain `fit` trains on them.
        data_lib.check_label_ranges(y, members)


def check_shardable(x: Any, n: int, given: dict | None = None) -> None:
    """Raises when `x` has fewer samples than the `n` members of a `data="shard"` pack, or,
    with `given` (the `fit` arguments of a pack whose members are fused), when a batch of
    array data would not split evenly among them."""
    leaves = [] if x is None else tree.flatten(x)
    sizes = {int(v.shape[0]) for v in leaves if hasattr(v, "shape") and len(v.shape)}
    if sizes and min(sizes) < n:
        raise ValueError(
            f'Invalid data for data="shard": {min(sizes)} samples for {n} members, so some '
            f"members would get no data. Pass at least {n} samples, or use "
            'data="replicate".'
        )
    if not sizes or given is None:
        return
    batch_size = given.get("batch_size") or 32
    samples = min(sizes)
    split = given.get("validation_split") or 0.0
    if split:  # the rows Keras keeps for training (`train_validation_split`)
        samples = int(math.floor(samples * (1.0 - split)))
    last = samples % batch_size
    if batch_size % n or last % n:
        uneven = f"batch_size={batch_size}" if batch_size % n else f"a last batch of {last} rows"
        raise data_lib.uneven_shard_error(uneven, n)


def with_progress_bar(n: int, callbacks: Any, verbose: Any) -> Any:
    """`callbacks` with `PackProgbar` in place of Keras's default progress bar: batch
    counts as a plain `fit` shows them and the `n` members in order (see `_progress`)."""
    if isinstance(callbacks, keras.callbacks.CallbackList) or verbose == 0:
        return callbacks
    callbacks = list(tree.flatten(callbacks or []))
    if not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        callbacks.append(PackProgbar(n))
    return callbacks


def fit_callbacks(model: keras.Model, callbacks: Any, extra: Sequence[Any] = ()) -> list:
    """The callbacks a pack's `fit` runs: the user's `callbacks` as each member needs them,
    then the pack's own.

    Keras's per-model callbacks run per member (`per_member_callbacks`), a non-chief
    worker's `BackupAndRestore` only reads (`_chief`), a `StatusWatcher` reports frozen
    members and ends `fit` when none trains, and `extra` (the XLA policy's) come last.

    Args:
        model: the pack.
        callbacks: the `callbacks` argument of `fit`.
        extra: more callbacks of the pack's. Defaults to `()`.
    """
    result = per_member_callbacks(_chief.chief_callbacks(model, list(callbacks or [])))
    result.append(StatusWatcher(list(result)))
    result.extend(extra)
    return result


def fit_step_counts(given: dict) -> list[int | None]:
    """The step counts a `fit` was given (`steps_per_epoch`, and `validation_steps` when
    it validates), for `steps_for`.

    Args:
        given: the `fit` call's arguments (`call_arguments`).
    """
    counts = [given["steps_per_epoch"]]
    if given["validation_data"] is not None or given["validation_split"]:
        counts.append(given["validation_steps"])
    return counts


def evaluate_values(logs: dict, names: Sequence[str]) -> Any:
    """`evaluate`'s result without `return_dict`: the figures in the order of `names`
    (`metrics_names`), then any others; one figure alone is returned as it is.

    Args:
        logs: the figures, by name.
        names: the pack's `metrics_names`.
    """
    values = [logs[k] for k in names if k in logs] + [v for k, v in logs.items() if k not in names]
    return values[0] if len(values) == 1 else values


def stacked_predictions(outputs: Sequence[Any]) -> np.ndarray:
    """The members' predictions as one array with a leading member axis.

    Raises:
        ValueError: the predictions differ in shape or are structures.
    """
    shapes = {tuple(np.shape(o)) for o in outputs}
    if len(shapes) != 1 or isinstance(outputs[0], (list, dict)):
        raise ValueError(
            "Invalid value for argument `stack`: members' predictions have different "
            f"shapes or structures ({sorted(shapes)}), so they cannot be stacked. Call "
            "`predict` with `stack=False` to get one array per member."
        )
    return np.stack(outputs)


@contextlib.contextmanager
def steps_for(
    model: keras.Model, auto: bool, callbacks: Any, counts: Sequence[int | None] = ()
) -> Iterator[None]:
    """Batches per compiled call of `model` for one `fit`, `evaluate` or `predict`.

    With `steps_per_execution="auto"` (`auto`: many batches per call) Keras would call a
    callback that acts on every batch once per call instead of once per batch, and run
    whole calls past the `steps_per_epoch`, `validation_steps` or `steps` the user
    counted (`counts`); a plain `fit` does neither (see `_batch_calls`).
    """
    steps = model.steps_per_execution
    wanted = steps
    if auto and not isinstance(callbacks, keras.callbacks.CallbackList):
        wanted = _batch_calls.steps_per_call(steps, callbacks or [], counts)
    if wanted == steps:
        yield
        return
    _reset_step_functions(model, wanted)
    try:
        yield
    finally:
        _reset_step_functions(model, steps)


def _reset_step_functions(model: keras.Model, steps: int) -> None:
    model.steps_per_execution = steps
    model.train_function = model.test_function = model.predict_function = None


_T = TypeVar("_T")


class Items(Sequence[_T]):
    """A fixed sequence of objects Keras must not track as the pack's own (members, engines).

    Members of a fused group are views of the stacked weights, not the pack's layers; the
    engines are plain objects whose Keras parts the pack tracks itself (`_engine_layers`).
    Not a list: Keras tracks lists, tuples, dicts and sets, not other sequences.
    """

    def __init__(self, items: Sequence[_T]) -> None:
        self._items = list(items)

    @overload
    def __getitem__(self, index: int) -> _T: ...

    @overload
    def __getitem__(self, index: slice) -> list[_T]: ...

    def __getitem__(self, index: int | slice) -> _T | list[_T]:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[_T]:
        return iter(self._items)
