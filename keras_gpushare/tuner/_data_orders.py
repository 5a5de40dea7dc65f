"""Trials trained together share one shuffled data order: say so where theirs would differ.

Keras's `fit` shuffles array data every epoch from the global random generators, which
`keras.utils.set_random_seed` seeds. A hypermodel that seeds each build (from a trial's
hyperparameters, say) gives each trial of plain KerasTuner its own order, drawn right after
its build. Trials trained together (a pack, a slots program) train on one order, the one
drawn when their program's `fit` began, so their scores are not the ones KerasTuner gives.
Where the builds left NumPy's generator (which `set_random_seed` seeds with the others) in
different states and the search shuffles array data, the search warns once, naming the
trials and the way out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from keras import tree


def random_state() -> str:
    """A digest of NumPy's global generator's state: equal digests, equal draws."""
    _, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    digest = hashlib.sha1(np.asarray(keys).tobytes()).hexdigest()
    return f"{digest}:{position}:{has_gauss}:{cached}"


@dataclasses.dataclass(frozen=True)
class BuildState:
    """What a trial model's build left of the random generators.

    Args:
        after: `random_state()` after the build.
        reseeded: whether the build changed it (it seeded the generators, or drew from
            them): its own `fit` would then draw an order of its own.
    """

    after: str
    reseeded: bool


def built(build: Callable[[], Any]) -> tuple[Any, BuildState]:
    """`build()`'s result, and what it left of the random generators."""
    before = random_state()
    result = build()
    after = random_state()
    return result, BuildState(after, after != before)


def _shuffles(fit_args: tuple, fit_kwargs: dict) -> bool:
    """Whether `fit` shuffles the data itself: `shuffle` is on and `x` holds arrays (a
    dataset, generator or `PyDataset` brings its own order)."""
    if not fit_kwargs.get("shuffle", True):
        return False
    x = fit_args[0] if fit_args else fit_kwargs.get("x")
    leaves = tree.flatten(x) if x is not None else []
    return bool(leaves) and all(hasattr(leaf, "shape") for leaf in leaves)


class OrderCheck:
    """Warns, once a search, when trials trained on one order would each draw their own
    (a search whose `fit` does not shuffle array data never warns).

    Args:
        fit_args: the search's positional `fit` arguments.
        fit_kwargs: its keyword arguments.
    """

    def __init__(self, fit_args: tuple, fit_kwargs: dict) -> None:
        self.shuffles = _shuffles(fit_args, fit_kwargs)
        self.warned = False

    def together(self, runs: Iterable[Any]) -> None:
        """`runs` (each with its `build_state`) begin one `fit`, on one data order."""
        runs = list(runs)
        states = {run.build_state.after for run in runs if run.build_state is not None}
        if len(states) > 1:
            self._warn(runs)

    def joins(self, run: Any, program_runs: Iterable[Any]) -> None:
        """`run` joins the `fit` of `program_runs` under way: it trains on that fit's next
        epochs' orders, where its own `fit` would begin from the state its build left."""
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
            "so their scores differ from KerasTuner's by that order. Pass `shuffle=False` "
            "to `search` to train every trial as KerasTuner does on the same code; this "
            "warning is shown once a search."
        )
        warnings.warn(message, UserWarning, stacklevel=2)
