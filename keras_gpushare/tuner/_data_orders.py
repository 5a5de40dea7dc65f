"""Each trial trains on the data order its own `fit` would draw.

Keras's `fit` shuffles array data every epoch from the global random generators, which
`keras.utils.set_random_seed` seeds. A hypermodel that seeds each build (from a trial's
hyperparameters, say) gives each trial of plain KerasTuner its own order, drawn right after
its build. Trials trained together (a pack, a slots program) would all train on the order
their program's `fit` draws. Where their builds left the generators in different states
(`BuildState`), each trial gets its own order instead: `TrialOrder` replays, epoch by
epoch, what the trial's own `fit` would draw (Keras's own epoch iterator over the sample
indices, driven as `fit` drives it, under the generator states the build left; on torch,
whose every `DataLoader` iterator draws a seed, its validation reads too), and
`DealtBatches` serves a program's batches with each member's rows in its own order
(`ModelPack(data="shard")` gives member i rows i, i+N, ... of each batch). Where that
cannot be done (below, `deal_problem`), the search warns once (`OrderCheck`), naming the
trials and the way out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import keras
import numpy as np
from keras import tree

from keras_gpushare import _upstream
from keras_gpushare.pack.program import needs_a_batch

_FIT_BATCH_SIZE = 32  # `fit`'s batch size when none is given


def random_state() -> str:
    """A digest of NumPy's global generator's state: equal digests, equal draws."""
    _, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    digest = hashlib.sha1(np.asarray(keys).tobytes()).hexdigest()
    return f"{digest}:{position}:{has_gauss}:{cached}"


def generator_states() -> tuple[Any, Any]:
    """The global generators a `fit` draws its order from: NumPy's state, and the
    backend's (TensorFlow's global seed state, torch's generator state; `None` on JAX)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return np.random.get_state(), _upstream.tf_seed_state()
    if backend == "torch":
        import torch

        return np.random.get_state(), torch.get_rng_state()
    return np.random.get_state(), None


def set_generator_states(states: tuple[Any, Any]) -> None:
    """Puts back what `generator_states` read."""
    numpy_state, backend_state = states
    np.random.set_state(numpy_state)
    if backend_state is None:
        return
    if keras.backend.backend() == "tensorflow":
        _upstream.set_tf_seed_state(backend_state)
    else:
        import torch

        torch.set_rng_state(backend_state)


@dataclasses.dataclass(frozen=True)
class BuildState:
    """What a trial model's build left of the random generators.

    Args:
        after: `random_state()` after the build.
        reseeded: whether the build changed it (it seeded the generators, or drew from
            them): its own `fit` would then draw an order of its own.
        generators: `generator_states()` after the build, from which its own `fit` would
            draw its order.
        reads_a_batch: whether its own `fit` would read a batch to build the model.
    """

    after: str
    reseeded: bool
    generators: Any = None
    reads_a_batch: bool = True


def built(build: Callable[[], Any]) -> tuple[Any, BuildState]:
    """`build()`'s result, and what it left of the random generators."""
    before = random_state()
    result = build()
    after = random_state()
    reads = isinstance(result, keras.Model) and needs_a_batch([result])
    return result, BuildState(after, after != before, generator_states(), reads)


def deal_problem(fit_args: tuple, fit_kwargs: dict) -> str | None:
    """Why a search's trials cannot each get their own order (`DealtBatches`), or `None`:
    the data must be arrays that `fit` shuffles itself, without `class_weight` or
    `steps_per_epoch` (which `DealtBatches` does not serve)."""
    if not _shuffles(fit_args, fit_kwargs):
        return "the search does not shuffle array data"
    if len(fit_args) > 2:
        return "`search` was given `fit` arguments beyond `x` and `y` by position"
    for name in ("class_weight", "steps_per_epoch"):
        if fit_kwargs.get(name) is not None:
            return f"`{name}` is given"
    return None


@dataclasses.dataclass(frozen=True)
class Validation:
    """How a trial's `fit` validates, where reading validation data draws from the
    generators (torch).

    Args:
        samples: the validation samples.
        batch_size: `fit`'s validation batch size.
        frequency: `validation_freq` (an epoch count, or the epochs, counted from 1).
        initial_epoch: the trial's first epoch.
    """

    samples: int
    batch_size: int
    frequency: Any
    initial_epoch: int

    def after(self, epochs: int) -> bool:
        """Whether `fit` validates at the end of its epoch `epochs` (counted from 1), as
        Keras's `Trainer._should_eval` decides."""
        if isinstance(self.frequency, int):
            return epochs % self.frequency == 0
        return epochs in self.frequency


class TrialOrder:
    """The batches of sample indices one trial's own `fit` would draw, epoch after epoch.

    Keras's own epoch iterator for the backend, over `np.arange(samples)`, driven as `fit`
    drives it: one batch read first where `fit` would build the model from one, then reset,
    then an epoch at a time; every time under the generator states its build left.

    Args:
        generators: `BuildState.generators` of the trial's build.
        samples: the training samples (after any `validation_split`).
        batch_size: the trial's batch size.
        shuffle: `fit`'s `shuffle`.
        steps_per_execution: the trial's compiled `steps_per_execution`.
        reads_a_batch: whether its `fit` reads a batch to build the model first.
        validation: where reading the validation data draws from the generators too
            (torch: each `DataLoader` iterator draws a seed), how its `fit` validates.
    """

    def __init__(
        self,
        generators: Any,
        samples: int,
        batch_size: int | None,
        shuffle: Any,
        steps_per_execution: int,
        reads_a_batch: bool,
        validation: Validation | None = None,
    ) -> None:
        self._generators = generators
        self._steps = steps_per_execution
        self._validation = validation
        self._validating: Any = None
        self._epoch = 0 if validation is None else validation.initial_epoch
        with self._drawing():
            self._iterator = _upstream.fit_epoch_iterator(
                np.arange(samples), batch_size, shuffle, steps_per_execution
            )
            if reads_a_batch:
                next(self._batches(self._iterator), None)
            self._iterator.reset()

    def next_epoch(self) -> list[np.ndarray]:
        """The index batches of the trial's next epoch, in order."""
        with self._drawing():
            batches = list(self._batches(self._iterator))
            validation, self._epoch = self._validation, self._epoch + 1
            if validation is not None and validation.after(self._epoch):
                # As `fit`'s `evaluate` reads its cached validation iterator.
                if self._validating is None:
                    self._validating = _upstream.fit_epoch_iterator(
                        np.arange(validation.samples), validation.batch_size, False, self._steps
                    )
                self._validating.reset()
                for _ in self._batches(self._validating):
                    pass
        return batches

    def _batches(self, iterator: Any) -> Iterator[np.ndarray]:
        for data in _upstream.epoch_iterator_data(iterator):
            if isinstance(data, (list, tuple)):
                batches = list(data)
            else:  # a backend iterator, which the step would pull its batches from
                batches = []
                with iterator.catch_stop_iteration():
                    for _ in range(self._steps):
                        batches.append(next(data))
            for batch in batches:
                yield np.asarray(keras.ops.convert_to_numpy(tree.flatten(batch)[0]))

    @contextlib.contextmanager
    def _drawing(self) -> Iterator[None]:
        """The trial's generator states in place of the global ones while it draws."""
        saved = generator_states()
        set_generator_states(self._generators)
        try:
            yield
        finally:
            self._generators = generator_states()
            set_generator_states(saved)


class DealtBatches(keras.utils.PyDataset):
    """A program's training batches, each member's rows in its own trial's order.

    Batch k holds, for each of the N slots, the rows of its trial's k-th batch (the order
    `set_orders` was given for the epoch), interleaved: row r belongs to slot r mod N, as
    `ModelPack(data="shard")` deals a batch. A slot with no order takes the rows in order.

    Args:
        data: the training arrays, `(x, y, sample_weight)` (`y`, `sample_weight` may be
            `None`; each any structure of arrays).
        batch_size: the trials' batch size.
        slots: N.
    """

    def __init__(self, data: tuple, batch_size: int, slots: int) -> None:
        super().__init__()
        self._data = data
        self._samples = int(tree.flatten(data[0])[0].shape[0])
        self._batch_size = batch_size
        self._in_order = [
            np.arange(start, min(start + batch_size, self._samples))
            for start in range(0, self._samples, batch_size)
        ]
        self._orders = [self._in_order] * slots

    @property
    def samples(self) -> int:
        return self._samples

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def set_orders(self, orders: list[list[np.ndarray] | None]) -> None:
        """Each slot's index batches for the next epoch (`None`: a slot with no trial)."""
        self._orders = [self._in_order if order is None else order for order in orders]

    def __len__(self) -> int:
        return math.ceil(self._samples / self._batch_size)

    def __getitem__(self, k: int) -> tuple:
        rows = np.stack([order[k] for order in self._orders], axis=1).reshape(-1)
        return tuple(
            tree.map_structure(lambda a: a[rows], part) for part in self._data if part is not None
        )


def _shuffles(fit_args: tuple, fit_kwargs: dict) -> bool:
    """Whether `fit` shuffles the data itself: `shuffle` is on and `x` holds arrays (a
    dataset, generator or `PyDataset` brings its own order)."""
    if not fit_kwargs.get("shuffle", True):
        return False
    x = fit_args[0] if fit_args else fit_kwargs.get("x")
    leaves = tree.flatten(x) if x is not None else []
    return bool(leaves) and all(hasattr(leaf, "shape") for leaf in leaves)


class OrderCheck:
    """Decides, per pack or program, whether its trials each get their own order
    (`DealtBatches`), and warns, once a search, when trials that would each draw their own
    train on one (a search whose `fit` does not shuffle array data never does either).

    Args:
        fit_args: the search's positional `fit` arguments.
        fit_kwargs: its keyword arguments.
    """

    def __init__(self, fit_args: tuple, fit_kwargs: dict) -> None:
        self.shuffles = _shuffles(fit_args, fit_kwargs)
        self.problem = deal_problem(fit_args, fit_kwargs)
        self.warned = False

    def deals(self, runs: Iterable[Any], program: bool = False) -> bool:
        """Whether `runs` (each with its `build_state`), about to begin one `fit`, each
        take their own order: their builds left the generators in different states (for a
        slots `program`, which later trials join, also where one build set them). Warns
        where they should but cannot."""
        runs = list(runs)
        states = [run.build_state for run in runs if run.build_state is not None]
        differ = len({state.after for state in states}) > 1
        if program:
            differ = differ or any(state.reseeded for state in states)
        if not differ or not self.shuffles:
            return False
        if self.problem is None:
            return True
        self._warn(runs)
        return False

    def joins(self, run: Any, program_runs: Iterable[Any]) -> None:
        """`run` joins the `fit` of `program_runs` under way on one order (a program that
        does not deal): it trains on that fit's next epochs' orders, where its own `fit`
        would begin from the state its build left."""
        if run.build_state is not None and run.build_state.reseeded:
            self._warn([*program_runs, run])

    def _warn(self, runs: list) -> None:
        if self.warned or not self.shuffles:
            return
        self.warned = True
        ids = ", ".join(dict.fromkeys(run.trial.trial_id for run in runs))
        message = (
            f"Trials {ids} train together on one shuffled data order, but their builds set "
            "the random generators (with `keras.utils.set_random_seed`, for instance): in "
            "plain KerasTuner each would shuffle its data in the order its own `fit` draws, "
            "so their scores differ from KerasTuner's by that order. Each trial gets its "
            f"own order only where it can, not here: {self.problem}. Pass `shuffle=False` "
            "to `search` to train every trial as KerasTuner does on the same code; this "
            "warning is shown once a search."
        )
        warnings.warn(message, UserWarning, stacklevel=2)


def dealt_arguments(
    fit_args: tuple, fit_kwargs: dict, batch_size: int | None, slots: int
) -> tuple[DealtBatches, dict]:
    """A program's `DealtBatches` and its other `fit` keyword arguments, from a search's
    `fit` arguments and its trials' `batch_size` (`None`: `fit`'s default): the training
    arrays less the rows `validation_split` keeps for validation (split as `fit` splits
    them), and validation in batches of the trials' size, as in their own `fit`."""
    batch_size = batch_size or _FIT_BATCH_SIZE
    kwargs = dict(fit_kwargs)
    given = list(fit_args) + [None] * (2 - len(fit_args))
    x = given[0] if given[0] is not None else kwargs.get("x")
    y = given[1] if given[1] is not None else kwargs.get("y")
    data = (x, y, kwargs.get("sample_weight"))
    split = kwargs.get("validation_split")
    if split and kwargs.get("validation_data") is None:  # as `fit`: validation_data wins
        data, validation = _upstream.train_validation_split(data, split)
        kwargs["validation_data"] = validation
    for name in ("x", "y", "sample_weight", "batch_size", "validation_split"):
        kwargs.pop(name, None)
    kwargs["shuffle"] = False
    if kwargs.get("validation_data") is not None:
        kwargs["validation_batch_size"] = kwargs.get("validation_batch_size") or batch_size
    return DealtBatches(tuple(data), batch_size, slots), kwargs


def trial_order(
    run: Any, dealt: tuple[DealtBatches, dict], fit_kwargs: dict, initial_epoch: int
) -> TrialOrder:
    """The order `run`'s own `fit` would draw on the samples of `dealt` (`dealt_arguments`
    of the search's `fit_kwargs`), from its epoch `initial_epoch` (`run.model` as its build
    returned it)."""
    dataset, kwargs = dealt
    validation = None
    data = kwargs.get("validation_data")
    if keras.backend.backend() == "torch" and data is not None:
        validation = Validation(
            int(tree.flatten(data)[0].shape[0]),
            kwargs["validation_batch_size"],
            kwargs.get("validation_freq", 1),
            initial_epoch,
        )
    state = run.build_state
    return TrialOrder(
        state.generators,
        dataset.samples,
        dataset.batch_size,
        fit_kwargs.get("shuffle", True),
        int(run.model.steps_per_execution),
        state.reads_a_batch,
        validation,
    )


class DealOrders(keras.callbacks.Callback):
    """Gives `dataset` each slot's order for the epoch about to begin.

    Args:
        dataset: the program's `DealtBatches`.
        orders: returns each slot's `TrialOrder`, `None` for a slot with no trial training.
    """

    def __init__(self, dataset: DealtBatches, orders: Callable[[], list]) -> None:
        super().__init__()
        self._dataset = dataset
        self._orders = orders

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._dataset.set_orders(
            [None if order is None else order.next_epoch() for order in self._orders()]
        )
