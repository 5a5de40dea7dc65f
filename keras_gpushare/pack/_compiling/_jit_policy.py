"""When XLA pays for a fused pack's training step (`jit_compile="auto"`).

XLA makes the fused engine's steady epoch up to three times faster on a CPU, but compiling
the step costs seconds per batch shape (two shapes when the last batch is short), which a
short `fit` never earns back: a pack of 8 small MLPs trained for 4 epochs took 9.0 s with XLA
and 4.5 s without, and on a busy machine longer than 8 plain fits (docs/benchmarks.md,
"Short fits and XLA", has the numbers). So the default decides by what XLA pays back:

- JAX: XLA (jit is JAX's only compiler; without it steps run eagerly).
- TensorFlow with a GPU: XLA, as before (compiling is short beside the steps it speeds up).
- torch, or layers XLA does not help (convolutions on a TensorFlow CPU): off.
- TensorFlow on a CPU: `fit` starts without XLA. After each call of the training function
  it knows the steady time of a batch (the first call, which traces the step, left out) and
  how many batches remain in this `fit`; it compiles the step with XLA for the rest of the
  `fit` only when the expected saving exceeds the expected compile time by a margin
  (`pays_back`). If XLA then turns out slower than the plain step, it goes back to it.

Both functions train the same variables, so switching between them mid-`fit` changes
nothing beyond float rounding.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack._backend import BACKEND

logger = logging.getLogger("keras_gpushare.pack")

XLA = "xla"
OFF = "off"
PAYBACK = "payback"


@dataclasses.dataclass(frozen=True)
class PaybackCosts:
    """What `pays_back` assumes about XLA on a TensorFlow CPU.

    Measured with benchmarks/short_fit.py on a shared 2-core CPU (docs/fusion.md, "Compile
    defaults"): XLA's steady epoch was 1.2x to 3.5x faster than the plain one, and it
    compiled a batch shape in 1.1 to 4.3 times the seconds the plain step took to trace.
    With these defaults XLA is compiled when the plain step's remaining time exceeds 18
    times its trace time: for the seeds' MLP x 16 on 25,000 samples, from about 14 epochs.

    Args:
        speedup: steady step time without XLA over the time with it. Defaults to `2.0`.
        compile_per_trace: seconds XLA takes to compile one batch shape of the step, per
            second the step took to trace without XLA. Defaults to `2.5`.
        shapes: batch shapes compiled (a short last batch is a second shape). Defaults to
            `2`.
        margin: how many times over the saving must repay the cost. Defaults to `1.5`.
    """

    speedup: float = 2.0
    compile_per_trace: float = 2.5
    shapes: int = 2
    margin: float = 1.5

    def compile_seconds(self, trace_seconds: float) -> float:
        """Expected cost of switching: tracing the step again, then compiling each shape."""
        return trace_seconds * (1.0 + self.shapes * self.compile_per_trace)


def pays_back(
    remaining_batches: float,
    seconds_per_batch: float,
    trace_seconds: float,
    costs: PaybackCosts | None = None,
) -> bool:
    """Whether compiling the step with XLA now repays its compile time in this `fit`.

    Args:
        remaining_batches: batches this `fit` still runs.
        seconds_per_batch: steady seconds of a batch without XLA.
        trace_seconds: seconds the step took to trace without XLA (its first call less
            the batches it ran).
        costs: the assumed speedup, compile cost and margin. Defaults to `None`:
            `PaybackCosts()`.

    Returns:
        `True` when `remaining_batches * seconds_per_batch * (1 - 1 / speedup)` exceeds
        `margin` times the expected compile time.
    """
    costs = costs or PaybackCosts()
    saving = remaining_batches * seconds_per_batch * (1.0 - 1.0 / costs.speedup)
    return saving > costs.margin * costs.compile_seconds(trace_seconds)


def choose_mode(supported: bool, backend: str, accelerator: bool) -> str:
    """The policy for a pack: `XLA`, `OFF` or `PAYBACK` (decide during `fit`).

    Args:
        supported: whether the pack's layers, backend and settings allow and gain from XLA
            (no eager steps, no `tf.distribute` strategy, no convolutions on a CPU).
        backend: Keras's backend name.
        accelerator: whether TensorFlow sees a GPU.
    """
    if not supported or backend == "torch":
        return OFF
    if backend != "tensorflow" or accelerator:
        return XLA
    return PAYBACK


class JitPolicy:
    """XLA for a pack's training step under `jit_compile="auto"`.

    The pack makes one at `compile` and adds its `callbacks()` to every `fit`. Under
    `PAYBACK` the pack compiles without XLA (`initial` is `False`) and the callback
    switches the training function to an XLA one when it pays back (see `pays_back`);
    evaluation and prediction stay without XLA, so validation compiles nothing.

    Args:
        mode: `XLA`, `OFF` or `PAYBACK` (see `choose_mode`).
        costs: what `pays_back` assumes. Defaults to `None`: `PaybackCosts()`.

    Example:

    ```python
    import keras
    import numpy as np

    from keras_gpushare.pack._compiling._jit_policy import JitPolicy

    policy = JitPolicy.for_pack(supported=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", jit_compile=policy.initial)
    x, y = np.zeros((64, 4), "float32"), np.zeros((64, 1), "float32")
    model.fit(x, y, epochs=2, verbose=0, callbacks=policy.callbacks())
    print(policy.xla_function is None)  # True
    ```

    Two epochs of two batches never repay a compile: on a TensorFlow CPU the step stays
    without XLA.
    """

    def __init__(self, mode: str, costs: PaybackCosts | None = None) -> None:
        if mode not in (XLA, OFF, PAYBACK):
            raise ValueError(
                f"Invalid value for argument `mode`: got {mode!r}. Expected one of "
                f"{XLA!r}, {OFF!r}, {PAYBACK!r}."
            )
        self.mode = mode
        self.costs = costs or PaybackCosts()
        # The plain training function last timed and its trace seconds; the XLA one.
        self.plain_function: Any = None
        self.trace_seconds: float | None = None
        self.xla_function: Any = None
        self.gave_up = False

    @classmethod
    def for_pack(cls, supported: bool, costs: PaybackCosts | None = None) -> JitPolicy:
        """The policy for this process's backend and devices (see `choose_mode`)."""
        return cls(choose_mode(supported, BACKEND.name, BACKEND.tensorflow_gpu()), costs)

    @property
    def initial(self) -> bool:
        """The `jit_compile` value to compile the pack with."""
        return self.mode == XLA

    def callbacks(self) -> list[keras.callbacks.Callback]:
        """The callbacks a `fit` needs: the switch under `PAYBACK`, else none."""
        return [PaybackSwitch(self)] if self.mode == PAYBACK and not self.gave_up else []


class _TimedFunction:
    """Keras's training function, timed call by call (the callback's stand-in for it)."""

    def __init__(self, switch: PaybackSwitch, function: Any) -> None:
        self.switch = switch
        self.function = function

    def __call__(self, iterator: Any) -> Any:
        start = time.perf_counter()
        logs = self.function(iterator)
        self.switch.record(time.perf_counter() - start)
        return logs


class PaybackSwitch(keras.callbacks.Callback):
    """Switches a `fit`'s training function to XLA when that pays back (see `pays_back`).

    Keras reads `model.train_function` at every call, so the callback puts a timed stand-in
    there at `on_train_begin` and changes what it calls; it uses no batch hook, so Keras's
    loop and the pack's batches per call stay as they are.

    Args:
        policy: the pack's `JitPolicy`, which keeps what one `fit` learnt for the next.
    """

    def __init__(self, policy: JitPolicy) -> None:
        super().__init__()
        self.policy = policy

    def on_train_begin(self, logs: dict | None = None) -> None:
        function = self.model.train_function
        if isinstance(function, _TimedFunction):  # a fit that raised left it there
            function = function.function
        self._plain = function
        self._state = XLA if function is self.policy.xla_function else "plain"
        self._steps = self.params.get("steps")
        self._epochs = int(self.params.get("epochs") or 1)
        self._per_call = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
        self._epoch, self._call = 0, 0
        self._epoch_batches: int | None = None
        self._plain_times: list[float] = []
        self._xla_times: list[float] = []
        self._first: tuple[float, int] | None = None
        self._xla_started = False
        if self._state == "plain" and not self.policy.gave_up:
            self.model.train_function = _TimedFunction(self, function)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._epoch_batches is None and self._call and epoch > self._epoch:
            # Data of unknown size: epoch 0 told how many calls an epoch takes.
            self._epoch_batches = self._call * self._per_call
        self._epoch, self._call = epoch, 0

    def on_train_end(self, logs: dict | None = None) -> None:
        function = self.model.train_function
        if isinstance(function, _TimedFunction):
            self.model.train_function = function.function

    # Measurements ------------------------------------------------------------------------

    def _batches(self, call: int) -> int:
        """Batches that call `call` of an epoch runs."""
        steps = self._steps or self._epoch_batches
        if not steps:
            return self._per_call
        return max(1, min(self._per_call, steps - call * self._per_call))

    def _remaining(self) -> float | None:
        """Batches left in this `fit` after the calls made so far (None: not known yet)."""
        steps = self._steps or self._epoch_batches
        if not steps:
            return None
        left_in_epoch = max(0, steps - self._call * self._per_call)
        return left_in_epoch + (self._epochs - self._epoch - 1) * steps

    def record(self, seconds: float) -> None:
        """Takes one call's seconds; decides after each call of the plain step."""
        batches = self._batches(self._call)
        self._call += 1
        if self._state == "plain":
            self._record_plain(seconds, batches)
        elif self._state == XLA:
            self._record_xla(seconds, batches)

    def _record_plain(self, seconds: float, batches: int) -> None:
        policy = self.policy
        if policy.plain_function is not self._plain:  # a new function: this call traced it
            policy.plain_function, policy.trace_seconds = self._plain, None
            self._first = (seconds, batches)
            return
        self._plain_times.append(seconds / batches)
        per_batch = statistics.median(self._plain_times)
        if self._first is not None:
            first_seconds, first_batches = self._first
            policy.trace_seconds = max(0.0, first_seconds - first_batches * per_batch)
        trace = policy.trace_seconds
        remaining = self._remaining()
        if trace is None or remaining is None or remaining <= 0:
            return
        if pays_back(remaining, per_batch, trace, self.policy.costs):
            logger.info(
                "ModelPack: compiling the training step with XLA for the remaining %d "
                "batches (%.2f ms a batch without XLA, step traced in %.2f s, compile "
                "expected to take %.1f s).",
                remaining,
                per_batch * 1e3,
                trace,
                self.policy.costs.compile_seconds(trace),
            )
            self._switch_to_xla()

    def _record_xla(self, seconds: float, batches: int) -> None:
        if not self._xla_started:
            self._xla_started = True
            logger.info("ModelPack: first XLA call took %.2f s (compile included).", seconds)
            return
        self._xla_times.append(seconds / batches)
        if len(self._xla_times) < 3 or not self._plain_times:
            return
        xla, plain = statistics.median(self._xla_times), statistics.median(self._plain_times)
        if xla >= plain:
            logger.info(
                "ModelPack: XLA step slower than the plain one (%.2f ms against %.2f ms a "
                "batch); going back to the plain step.",
                xla * 1e3,
                plain * 1e3,
            )
            self.policy.gave_up = True
            self.policy.xla_function = None
            self._state = "plain-final"
            self.model.train_function.function = self._plain
        else:
            self._state = "xla-final"

    def _switch_to_xla(self) -> None:
        """Builds Keras's training function with XLA and calls it from the next call on.

        Only the training function: `jit_compile` is set back at once, so evaluation and
        prediction functions made later keep the plain step.
        """
        model = self.model
        timed = model.train_function
        if not _upstream.model_supports_jit(model):  # Keras would refuse XLA here
            self.policy.gave_up = True
            self._state = "plain-final"
            return
        previous = model.jit_compile
        model.jit_compile = True
        try:
            model.make_train_function(force=True)
            xla = model.train_function
        finally:
            model.jit_compile = previous
            model.train_function = timed
        self.policy.xla_function = xla
        timed.function = xla
        self._state = XLA
