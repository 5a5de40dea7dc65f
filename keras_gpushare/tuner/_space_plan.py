"""Programs planned from the search space: probe builds of the hypermodel before any trial.

The slots executor keeps each program it compiles for the rest of the search, and a trial
loads into a slot whose fused layers are as wide as its own, hold its activation and its
optimizer's family, and may be left out where the trial is shallower. Shaped by the first
trials alone, a program often lacks what a later trial needs (a third layer, a wider one,
another activation), and another program is compiled. So before opening its first program
the executor learns the space: it builds the hypermodel at points no trial has (`probe`),
chosen from the oracle's declared hyperparameters (`keras_tuner.HyperParameters`):

- numbers (`Int`, and `Choice`s of numbers: depths, widths) at their maximum and at their
  minimum, alternately, so that the program holds the widest and deepest layers and may
  leave out the layers a shallower trial lacks;
- every value of the other `Choice`s and of `Boolean`s in turn (activations, optimizer
  families, an optional layer, conditional branches), so that each is in some slot;
- `Float`s (rates) at their default, which shapes nothing.

A build declares what the space did not know yet (`units_2` of a third layer): the points
are built again with it, at most `MAX_ROUNDS` times. One program is then opened with one
probe model per slot (`SpacePlan.models`); the trials are loaded into its slots, as trials
refill a program's slots, and a trial that fits none opens a program of its own as before.

Probes change nothing a trial sees (`untouched`): Python's, NumPy's, the backend's and
Keras's random generators and Keras's layer-name counters are put back after them, so each
trial builds the same weights and layer names, and draws the same data order, as without
probes. They never reach the oracle, and a probe whose build raises is skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from keras_gpushare import _upstream
from keras_gpushare.pack.program import fuse_problem
from keras_gpushare.tuner._executor import error_line

# Builds of every point again while they declare hyperparameters the space lacked.
MAX_ROUNDS = 3


@dataclasses.dataclass
class SpacePlan:
    """What the probes found: a model for each slot of the planned program.

    Args:
        models: one probe model per slot, each at a point of the space.
        builds: the probe builds made (those skipped included).
        seconds: the seconds they took.
        skipped: why probes were left out of the program (a build raised, a model does
            not fuse), one line each.
    """

    models: list[keras.Model]
    builds: int
    seconds: float
    skipped: list[str] = dataclasses.field(default_factory=list)

    def why(self, templates: int) -> str:
        """Why the planned program was opened, for the trials' paths."""
        line = (
            f"planned from the space: {templates} template{'s' if templates != 1 else ''} "
            f"from {self.builds} probe builds ({self.seconds:.1f} s)"
        )
        return line + (f"; left out: {'; '.join(self.skipped)}" if self.skipped else "")


@contextlib.contextmanager
def untouched() -> Iterator[None]:
    """Puts back, on leaving, every global state a model's build may change: Python's,
    NumPy's, TensorFlow's and torch's random generators, Keras's global state (its
    `SeedGenerator`, the global seed and the counters that name layers)."""
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    keras_state = _upstream.keras_global_state()
    tf_state = None
    if sys.modules.get("tensorflow") is not None:  # imported, and not blocked with None
        generator = _upstream.tf_global_generator()
        saved = None if generator is None else generator.state.numpy()
        tf_state = (_upstream.tf_seed_state(), generator, saved)
    torch_state = None
    if keras.backend.backend() == "torch":
        import torch

        torch_state = torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        _upstream.set_keras_global_state(keras_state)
        if tf_state is not None:
            seeds, generator, saved = tf_state
            _upstream.set_tf_seed_state(seeds)
            _upstream.set_tf_global_generator(generator)
            if generator is not None:
                generator.state.assign(saved)
        if torch_state is not None:
            import torch

            torch.set_rng_state(torch_state)


def points(space: Any, count: int) -> list[dict[str, Any]]:
    """`count` points of `space` (a `keras_tuner.HyperParameters`) that together hold each
    number's maximum and minimum and every other choice (see the module docstring)."""
    result = []
    for i in range(count):
        values = {}
        for hp in space.space:
            value = _value(hp, i)
            if value is not None:
                values[hp.name] = value
        result.append(values)
    return result


def distinct_points(space: Any) -> int:
    """How many points hold every value `points` cycles through (at least 2: a maximum
    and a minimum)."""
    lengths = [len(_cycled(hp)) for hp in space.space]
    return max([2, *lengths])


def _cycled(hp: Any) -> list:
    """The values of `hp` taken in turn (the other choices), or `[]`."""
    kind = type(hp).__name__
    if kind == "Boolean":
        return [True, False]
    if kind != "Choice" or _numbers(hp.values):
        return []
    return list(hp.values)


def _numbers(values: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _value(hp: Any, i: int) -> Any:
    """Point `i`'s value of `hp`: a number's maximum (even `i`) or minimum (odd), the
    `i`-th of other choices, `None` for what shapes nothing (its default stays)."""
    cycled = _cycled(hp)
    if cycled:
        return cycled[i % len(cycled)]
    kind = type(hp).__name__
    if kind == "Choice":
        return max(hp.values) if i % 2 == 0 else min(hp.values)
    if kind == "Int":
        return hp.max_value if i % 2 == 0 else hp.min_value
    return None


def probe(space: Any, build: Callable[[Any], keras.Model], slots: int) -> SpacePlan | None:
    """Builds the hypermodel at `slots` points of `space` (see the module docstring).

    Args:
        space: the oracle's space (a copy: `oracle.get_space()`), grown here only.
        build: builds a trial's model from hyperparameters, as the tuner builds one.
        slots: the program's slots.

    Returns:
        The plan, or `None` when no probe model fuses (nothing to plan).
    """
    start = time.perf_counter()
    builds = 0
    skipped: list[str] = []
    with untouched():
        for _ in range(MAX_ROUNDS):
            count = min(slots, distinct_points(space))
            known = {hp.name for hp in space.space}
            models, grown, why = [], False, []
            for values in points(space, count):
                hp = space.copy()
                hp.values.update(values)
                builds += 1
                try:
                    models.append((values, build(hp)))
                except Exception as e:
                    why.append(f"a probe build raised {error_line(e)}")
                    continue
                new = [p for p in hp.space if p.name not in known]
                if new:
                    space.merge(new, overwrite=False)
                    known.update(p.name for p in new)
                    grown = True
            if not grown:
                break
        fusing = []
        for values, model in models:
            problem = fuse_problem(model)
            if problem is not None:
                why.append(f"a probe at {values} does not fuse: {problem}")
            else:
                fusing.append(values)
        skipped.extend(dict.fromkeys(why))
        if not fusing:
            return None
        cover = [model for values, model in models if values in fusing]
        for i in range(len(cover), slots):
            hp = space.copy()
            hp.values.update(fusing[i % len(fusing)])
            builds += 1
            cover.append(build(hp))
    return SpacePlan(cover, builds, time.perf_counter() - start, skipped)
