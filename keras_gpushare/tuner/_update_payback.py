"""When a slots program's optimizer update pays for an XLA compile of its own.

A program built for slots computes every optimizer family's rule over every slot's full
capacity: a dozen element-wise passes over the stacked weights and their slots, which
TensorFlow's CPU kernels run one by one. Compiled apart with XLA
(`VectorizedOptimizer.fuse_update`) they become a few fused passes: on a 2-core Intel CPU,
16 getting-started slots (5.4 million stacked parameters) took 14.9 s of steady epochs
against 18.8 s without (docs/benchmarks.md, "A fused optimizer update"), about 1.4 ms a
step per million stacked parameters. The compile, and XLA's start-up the first time a process
compiles anything, cost about two seconds (the program's fixed cost, 6.8 s against 4.1-5.2 s),
which a short search never earns back
(16 trials of 3 epochs on 2,048 samples: 6.9 s against 6.4 s). So the executor estimates
the steps a program will run from the search's remaining trials, and fuses its update only
where the saving exceeds the compile by a margin.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class UpdateCosts:
    """What `fuse_update_pays` assumes (measured as the module docstring says).

    Args:
        saving_per_million: seconds a step saves per million stacked parameters. Defaults
            to `1.4e-3`.
        compile_seconds: the fused update's compile, XLA's start-up included. Defaults to
            `2.0`.
        margin: how many times over the saving must repay the compile. Defaults to `1.5`.
    """

    saving_per_million: float = 1.4e-3
    compile_seconds: float = 2.0
    margin: float = 1.5


def fuse_update_pays(
    steps: float | None, parameters: int, costs: UpdateCosts | None = None
) -> bool:
    """Whether a program of `parameters` stacked parameters, expected to run `steps` more
    steps, repays compiling its update with XLA (`False` when `steps` is not known).

    Args:
        steps: the program's expected steps, or `None`.
        parameters: its stacked trainable parameters.
        costs: the assumed saving and compile time. Defaults to `None`: `UpdateCosts()`.
    """
    if steps is None:
        return False
    costs = costs or UpdateCosts()
    saving = steps * parameters / 1e6 * costs.saving_per_million
    return saving > costs.margin * costs.compile_seconds


def expected_steps(
    trial_epochs: float | None, slots: int, batch_size: Any, fit_args: tuple, fit_kwargs: dict
) -> float | None:
    """The steps a program of `slots` slots runs for `trial_epochs` trial-epochs in all,
    each epoch of the training arrays given to `search` (`None` for other data, or when the
    trials to come are not known).

    Args:
        trial_epochs: the epochs its trials (present and expected) train, summed.
        slots: the program's slots.
        batch_size: the trials' batch size (`None`: Keras's 32).
        fit_args: `search`'s positional arguments.
        fit_kwargs: `search`'s keyword arguments.
    """
    x = fit_args[0] if fit_args else fit_kwargs.get("x")
    shape = getattr(x, "shape", None)
    if trial_epochs is None or not shape or shape[0] is None:
        return None
    split = 0.0 if fit_kwargs.get("validation_data") else fit_kwargs.get("validation_split", 0.0)
    samples = int(int(shape[0]) * (1.0 - (split or 0.0)))
    batches = math.ceil(samples / int(batch_size or 32))
    return math.ceil(trial_epochs / slots) * batches
