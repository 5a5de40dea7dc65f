"""The GPU table of docs/benchmarks.md in one short run: Keras on JAX, no TensorFlow.

Measured in this run, every figure a median [min-max] over the repeats:

- the seeds' MLP (10-64-32-1, Adam, binary cross-entropy, batch 32, 25,000 random rows of 10
  features) x N as one `ModelPack`, against N plain `fit`s one after another, for N = 16 and
  64. The plain fits are the same whatever N, so a few run per repeat
  (`--sequential-at-most`) and their time is scaled to N, as benchmarks/_sampled_sequential.py
  does;
- the largest N as a `torch.func` ensemble (benchmarks/_torch_ensemble.py: vmap +
  functional_call, one Adam over the stacked parameters), when torch sees a CUDA device;
- the one-time cost at N = 1, 16, 64: from `ModelPack(members)` to the end of the fit, less
  the epochs at the steady rate, against one plain model's (from `compile`);
- GPU utilisation and SM activity during each Keras fit (`UtilizationLogger`, means of the
  steady epochs) and during the torch run (the monitor's sampler), when pynvml and a GPU
  answer;
- then, once, after the first repeat, the large packs (N = 256 and 1,024, 3 epochs; 1,024
  only when 3x the 256 row's seconds are left): their model-samples/s against the N = 64
  pack's, and the kernels of each pack's compiled training step (XLA fusions and custom
  calls in its optimized HLO), a one-member pack's for reference: what a launch-bound GPU
  pays a step;
- then, once, after the first repeat: a KerasTuner search of its getting-started space
  (benchmarks/_tuner_spaces.py, RandomSearch, seed 1) at 32 and 64 trials, plain
  `keras_tuner.RandomSearch` against `ParallelTuner(parallel_trials=16)` with its default
  executor (the programs it compiled and the share of their FLOPs that trained no trial,
  from the search's own log line) and, as the budget allows, `executor="pack"`, then the
  64-trial search through one GPU's worker process (`devices=[0]`, the path of a machine's
  GPUs, beside the in-process executor): wall seconds of `search` and the ratio with plain
  KerasTuner. Plain KerasTuner compiles every trial's model anew (1-2 s a trial on JAX), so
  its first 16 trials (the same as every search's first 16) are timed and scaled to 32 and
  64. The section runs in one
  process after a warm-up fit; it is skipped, with a line saying so, when its estimate does
  not fit what is left of the budget, and a search is not started when its estimate (from
  this run's searches) would not fit the section's share.

"End to end" runs from `ModelPack(members)` (a plain model: from `compile`) to the end of
`fit`: tracing and XLA compiling included, building the Keras members (the same for both
sides) and the monitor's own start and stop left out (both printed). "Steady" is the median of
the epochs after the first (JAX compiles the full and the last, partial batch in epoch 1).

Each repeat runs the Keras rows in one fresh process, after a warm-up fit of other shapes
(CUDA, cuBLAS and XLA start outside the timings), in an order rotated each repeat, and the
torch row in another process (torch warmed up the same way). TensorFlow is never imported:
the workers put None in `sys.modules["tensorflow"]`, as on the GPU machine, which has none.
Each measurement is printed when it is taken and the table is rewritten after each one, so a
run stopped at its time limit still leaves what it measured. A worker is not started when its
last run would not fit in what is left of `--budget` seconds.

    bash benchmarks/gpu.sh "$OUT"                   # the way to run it (see that script)
    KERAS_BACKEND=jax python benchmarks/gpu_table.py --out gpu_table.md --log gpu_log.txt
    KERAS_BACKEND=jax python benchmarks/gpu_table.py --cpu-smoke   # tiny sizes, on the CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the repository, for keras_gpushare
_RESULT = "@@gpu_table "
_BATCH = 32
_MONITOR_INTERVAL_S = 0.2

# GPU sizes. From the H200 run in docs/benchmarks.md, estimated: about 45 s of Keras rows and
# 20 s of torch per repeat, so that 2-3 repeats fit the budget, less the tuner section's.
# The tuner section's `guess_s` (seconds to start the process and warm up, per plain trial,
# per ParallelTuner trial) are a priori guesses: plain KerasTuner on JAX compiles each trial's
# model, 1-2 s on the H200; ParallelTuner's searches were not yet measured there. They put
# the plain and default-executor searches at about 70 s; `cap_s` caps the section, pack searches
# included, which run as they fit.
_GPU = {
    "samples": 25_000,
    "epochs": 4,
    "warmup": 1,
    "members": [16, 64],
    # Large packs, once (after the first repeat), timed and their step's kernels counted;
    # 1024 only when 3x the 256 row's seconds are left. `guess_s`: the section's a priori
    # estimate (building 1,280 members dominates it).
    "large": {"members": [256, 1024], "epochs": 3, "guess_s": 60.0},
    "sequential": 2,
    "repeats": 3,
    "budget": 195.0,
    "tuner": {
        "samples": 4096,
        "epochs": 3,
        "batch": 64,
        "trials": [32, 64],
        "parallel_trials": 16,
        "plain_trials": 16,
        "guess_s": {"start": 10.0, "plain": 1.5, "parallel": 0.4},
        "cap_s": 85.0,
    },
}
# The same tables at tiny sizes in about a minute and a half on two CPU cores.
_SMOKE = {
    "samples": 512,
    "epochs": 3,
    "warmup": 1,
    "members": [16, 64],
    "large": {"members": [128], "epochs": 3, "guess_s": 30.0},
    "sequential": 2,
    "repeats": 2,
    "budget": 170.0,
    "tuner": {
        "samples": 256,
        "epochs": 2,
        "batch": 64,
        "trials": [4, 8],
        "parallel_trials": 4,
        "plain_trials": 2,
        "guess_s": {"start": 8.0, "plain": 2.5, "parallel": 1.5},
        "cap_s": 70.0,
    },
}
_TUNER_NAMES = {
    "plain": "KerasTuner RandomSearch",
    "auto": "ParallelTuner, default executor",
    "pack": 'ParallelTuner executor="pack"',
    "devices": "ParallelTuner devices=[0] (one GPU's worker process, default executor)",
}


# --------------------------------------------------------------------------- workers


def _emit(record: dict[str, Any]) -> None:
    print(_RESULT + json.dumps(record), flush=True)


def _no_tensorflow() -> None:
    """Makes `import tensorflow` fail here as on the GPU machine, which has no TensorFlow."""
    if "tensorflow" in sys.modules and sys.modules["tensorflow"] is not None:
        raise RuntimeError("TensorFlow was imported before the benchmark started.")
    sys.modules["tensorflow"] = None  # `import tensorflow` raises ModuleNotFoundError


def _monitor_state(on_gpu: bool) -> str | None:
    """None when GPU figures can be read, else why not."""
    import importlib.util

    if not on_gpu:
        return "no GPU"
    if importlib.util.find_spec("pynvml") is None:
        return "pynvml (nvidia-ml-py) is not installed"
    return None


def _steady(epochs: list[float], warmup: int) -> float:
    return statistics.median(epochs[warmup:] or epochs[-1:])


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v == v]  # NaN: not read
    return sum(values) / len(values) if values else None


def _keras_fit(
    n: int, pack: bool, data: tuple, sizes: dict[str, Any], monitor: bool, count: bool = False
) -> dict:
    """One timed fit: a ModelPack of `n` seeds' MLPs, or one plain model (`pack=False`);
    with `count`, the XLA kernels of the pack's training step too (`_step_kernels`, after
    the timed fit)."""
    import keras

    import keras_gpushare as kg
    from keras_gpushare._seeds_benchmark.workload import build_mlp, epoch_timer

    class Mark(keras.callbacks.Callback):
        """Notes when `fit` reached it at train begin and end (to time the monitor)."""

        async_safe = True

        def on_train_begin(self, logs=None):
            self.begin = time.perf_counter()

        def on_train_end(self, logs=None):
            self.end = time.perf_counter()

    x, y = data
    timer = epoch_timer()
    callbacks: list[Any] = [timer]
    if monitor:
        logger = kg.callbacks.UtilizationLogger(interval=_MONITOR_INTERVAL_S)
        marks = (Mark(), Mark())
        callbacks += [marks[0], logger, marks[1]]
    start = time.perf_counter()
    members = [build_mlp(64, seed=i) for i in range(n)]
    built = time.perf_counter()
    model = kg.ModelPack(members) if pack else members[0]
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit(
        x, y, batch_size=_BATCH, epochs=sizes["epochs"], verbose=0, callbacks=callbacks
    )
    end = time.perf_counter()
    record = {
        "n": n,
        "build_s": built - start,
        "e2e_s": end - built,
        "epoch_s": timer.times,
        "engine": model.engine if pack else "plain",
    }
    if count:
        record["kernels"] = _step_kernels(model, x, y)
    if monitor:
        monitor_s = (marks[1].begin - marks[0].begin) + (marks[1].end - marks[0].end)
        record["e2e_s"] -= monitor_s
        record["monitor_s"] = monitor_s
        steady = slice(sizes["warmup"], None)
        for key, name in (("gpu0_util", "util"), ("gpu0_sm_active", "sm_active")):
            record[name] = _mean(history.history.get(key, [])[steady])
        record["advice"] = logger.advice
    return record


def _step_kernels(pack: Any, x: Any, y: Any) -> dict[str, int]:
    """The kernels of the pack's compiled one-batch training step: XLA fusions and custom
    calls (cuBLAS matmuls on a GPU), counted in its optimized HLO (as
    tests/pack/step_counts.py counts them)."""
    import re

    import jax

    state = (
        [v.value for v in pack.trainable_variables],
        [v.value for v in pack.non_trainable_variables],
        [v.value for v in pack.optimizer.variables],
        [v.value for v in pack.metrics_variables],
    )
    text = jax.jit(pack.train_step).lower(state, (x[:_BATCH], y[:_BATCH])).compile().as_text()
    return {
        "fusions": len(re.findall(r"\sfusion\(", text)),
        "custom_calls": len(re.findall(r"\scustom-call\(", text)),
    }


def _warm_up_keras() -> None:
    """A plain fit and a two-member pack of the seeds' MLP at batch 16: starts CUDA, cuBLAS
    and XLA, and runs the eager ops that build these layers, so that the first measured row
    pays no more than the others; no train step a measured row runs (batch 32) is compiled."""
    import keras_gpushare as kg
    from keras_gpushare._seeds_benchmark.workload import build_mlp, make_data

    x, y = make_data(48, seed=1)
    plain = build_mlp(64, seed=101)
    pack = kg.ModelPack([build_mlp(64, seed=102), build_mlp(64, seed=103)])
    for model in (plain, pack):
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def _jax_worker(sizes: dict[str, Any], repeat: int, smoke: bool) -> int:
    _no_tensorflow()
    import jax
    import keras

    from keras_gpushare._seeds_benchmark.workload import make_data

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    _emit(
        {
            "kind": "env",
            "keras": keras.__version__,
            "backend": keras.backend.backend(),
            "jax": jax.__version__,
            "jax_device": gpus[0].device_kind if gpus else jax.devices()[0].platform,
        }
    )
    if keras.backend.backend() != "jax":
        _emit({"kind": "fatal", "error": "set KERAS_BACKEND=jax (benchmarks/gpu.sh does)"})
        return 2
    if not gpus and not smoke:
        _emit({"kind": "fatal", "error": f"JAX sees no GPU (devices: {jax.devices()})"})
        return 2
    unavailable = _monitor_state(bool(gpus))
    _emit({"kind": "monitor", "unavailable": unavailable})
    _warm_up_keras()
    data = make_data(sizes["samples"])
    rows = [("plain", 1)] + [("pack", n) for n in [1, *sizes["members"]]]
    shift = repeat % len(rows)
    for what, n in rows[shift:] + rows[:shift]:
        try:
            if what == "plain":
                fits = [
                    _keras_fit(1, False, data, sizes, unavailable is None)
                    for _ in range(sizes["sequential"])
                ]
                _emit({"kind": "plain", "repeat": repeat, "fits": fits})
            else:
                fit = _keras_fit(n, True, data, sizes, unavailable is None)
                _emit({"kind": "pack", "repeat": repeat, **fit})
        except Exception as e:  # a row that fails here is reported, the others still run
            traceback.print_exc()
            _emit({"kind": "error", "what": f"{what} N={n}", "error": f"{type(e).__name__}: {e}"})
    return 0


def _large_worker(sizes: dict[str, Any], repeat: int, smoke: bool) -> int:
    """The large packs (`sizes["large"]`), once: a timed fit each and its step's kernels,
    and the kernels of a one-member pack's step for reference. A pack is not started when
    less than 3x the previous row's seconds are left before `deadline`."""
    _no_tensorflow()
    import jax

    from keras_gpushare._seeds_benchmark.workload import make_data

    large = sizes["large"]
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus and not smoke:
        _emit({"kind": "fatal", "error": f"JAX sees no GPU (devices: {jax.devices()})"})
        return 2
    monitor = _monitor_state(bool(gpus)) is None
    _warm_up_keras()
    data = make_data(sizes["samples"])
    reference = make_data(4 * _BATCH, seed=2)
    one = _keras_fit(1, True, reference, {**sizes, "epochs": 1}, False, count=True)
    _emit({"kind": "large-reference", "kernels": one["kernels"]})
    last_s = 0.0
    for n in large["members"]:
        left = large["deadline"] - time.time()
        if 3 * last_s > left:
            text = f"N={n} not started ({left:.0f} s left, the last row took {last_s:.0f} s)"
            _emit({"kind": "large-note", "text": text})
            break
        began = time.time()
        try:
            fit = _keras_fit(n, True, data, {**sizes, "epochs": large["epochs"]}, monitor, True)
        except Exception as e:  # reported under the table
            traceback.print_exc()
            _emit({"kind": "large-note", "text": f"N={n} failed: {type(e).__name__}: {e}"})
            break
        _emit({"kind": "large", "repeat": repeat, **fit})
        last_s = time.time() - began
    return 0


def _torch_worker(sizes: dict[str, Any], repeat: int, smoke: bool) -> int:
    _no_tensorflow()
    try:
        import torch
    except ImportError:
        _emit({"kind": "skip", "what": "torch-vmap", "why": "torch is not installed"})
        return 0
    on_gpu = torch.cuda.is_available()
    _emit(
        {
            "kind": "env",
            "torch": torch.__version__,
            "torch_device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        }
    )
    if not on_gpu and not smoke:
        _emit({"kind": "skip", "what": "torch-vmap", "why": "torch sees no CUDA device"})
        return 0
    sys.path.insert(0, _HERE)
    from _torch_ensemble import run_torch_vmap

    n = max(sizes["members"])
    base = {"epochs": sizes["epochs"], "warmup": sizes["warmup"], "threads": 1}
    # Warm-up: CUDA context, cuBLAS handles and torch.func's first trace stay out of the run.
    run_torch_vmap({**base, "samples": 256, "epochs": 1, "widths": [64] * 2})
    sampler = None
    if _monitor_state(on_gpu) is None:
        from keras_gpushare.monitor.nvml import NvmlReader
        from keras_gpushare.monitor.sampler import Sampler

        sampler = Sampler(NvmlReader(), _MONITOR_INTERVAL_S, windows=("run",))
        sampler.start()
        sampler.take("run")
    try:
        result = run_torch_vmap({**base, "samples": sizes["samples"], "widths": [64] * n})
    except Exception as e:  # reported in the table's notes; the traceback goes to the log
        traceback.print_exc()
        _emit({"kind": "error", "what": f"torch-vmap N={n}", "error": f"{type(e).__name__}: {e}"})
        return 1
    record = {
        "kind": "torch",
        "repeat": repeat,
        "n": n,
        "e2e_s": result["wall_s"],
        "epoch_s": result["epoch_s"],
        "threads": result["threads"],
    }
    if sampler is not None:
        figures, _ = sampler.take("run")
        sampler.stop()
        record["util"] = figures.get("gpu0_util")
        record["sm_active"] = figures.get("gpu0_sm_active")
    _emit(record)
    return 0


def _tuner_searches(tuner: dict[str, Any]) -> list[tuple[str, int]]:
    """The tuner section's searches, in the order they run: plain KerasTuner on its sample
    of trials, the default executor at each trial count, the pack executor, then the largest
    count through one device's worker process (`devices`: the path of a machine's GPUs,
    here with one)."""
    searches = [("plain", tuner["plain_trials"])]
    searches += [(m, t) for m in ("auto", "pack") for t in tuner["trials"]]
    return searches + [("devices", tuner["trials"][-1])]


def _tuner_estimate(tuner: dict[str, Any], method: str, trials: int, per_trial: dict) -> float:
    """Seconds a search should take: `trials` x the seconds a trial took in this run's
    searches of its method (of the other ParallelTuner executor's, before its own), else x
    the a priori guess."""
    if method == "plain":
        rate = per_trial.get("plain", tuner["guess_s"]["plain"])
    elif method == "devices":  # the worker's start (imports, first program), then slots
        rate = per_trial.get("auto", tuner["guess_s"]["parallel"])
        return tuner["guess_s"]["start"] + trials * rate
    else:
        other = "pack" if method == "auto" else "auto"
        rate = per_trial.get(method, per_trial.get(other, tuner["guess_s"]["parallel"]))
    return trials * rate


class _Lines(logging.Handler):
    """Keeps the messages of the records it is given, in `lines`."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _compiled_figures(lines: list[str]) -> dict[str, Any]:
    """The programs a search compiled and the share of their FLOPs that trained no trial,
    read from its own closing log line ("Search: ... 1 program compiled ...; 25% of the
    FLOPs the programs computed trained no trial ..."); {} for a search that logs none."""
    line = next((text for text in reversed(lines) if text.startswith("Search: ")), "")
    programs = re.search(r"(\d+) (?:program|pack)s? compiled", line)
    padding = re.search(r"(\d+)% of the FLOPs", line)
    figures: dict[str, Any] = {}
    if programs:
        figures["programs"] = int(programs.group(1))
    if padding:
        figures["padding"] = int(padding.group(1))
    return figures


def _tuner_worker(sizes: dict[str, Any], repeat: int, smoke: bool) -> int:
    """The tuner section: the searches of `_tuner_searches`, each started when its estimate
    fits before the section's `deadline` (`time.time()`, set by the driver)."""
    _no_tensorflow()
    tuner = sizes["tuner"]
    try:
        import keras_tuner
    except Exception as e:  # not installed, or not importable here (its protobuf files)
        why = f"KerasTuner cannot be imported ({e}); benchmarks/gpu_wheels.sh fetches its wheels"
        _emit({"kind": "tuner-note", "text": f"The tuner table was not measured: {why}."})
        return 0
    import keras_gpushare as kg

    sys.path.insert(0, _HERE)
    from _tuner_spaces import build_getting_started, make_data

    _emit({"kind": "env", "keras_tuner": keras_tuner.__version__})
    _warm_up_keras()
    x, y = make_data(tuner["samples"], "getting-started")
    root = tempfile.mkdtemp(prefix="gpu-table-tuner-")
    compiled: list[str] = []  # the search's "Search: ..." log line (programs, padding)
    handler = _Lines(compiled)
    tuner_log = logging.getLogger("keras_gpushare.tuner")
    tuner_log.addHandler(handler)
    tuner_log.setLevel(logging.INFO)
    per_trial: dict[str, float] = {}
    try:
        for method, trials in _tuner_searches(tuner):
            left = tuner["deadline"] - time.time()
            estimate = _tuner_estimate(tuner, method, trials, per_trial)
            name = f"{_TUNER_NAMES[method]}, {trials} trials"
            if estimate > left:
                text = f"{name}: not started (estimated {estimate:.0f} s, {left:.0f} s left)"
                _emit({"kind": "tuner-note", "text": text})
                continue
            common = dict(
                objective="val_loss",
                max_trials=trials,
                seed=1,
                directory=root,
                project_name=f"{method}-{trials}",
                overwrite=True,
            )
            if method == "plain":
                search = keras_tuner.RandomSearch(build_getting_started, **common)
            elif method == "devices":
                search = kg.tuner.ParallelTuner(
                    build_getting_started,
                    parallel_trials=tuner["parallel_trials"],
                    devices=["cpu0"] if smoke else [0],
                    **common,
                )
            else:
                search = kg.tuner.ParallelTuner(
                    build_getting_started,
                    parallel_trials=tuner["parallel_trials"],
                    executor=method,
                    **common,
                )
            compiled.clear()
            start = time.perf_counter()
            try:
                search.search(
                    x,
                    y,
                    epochs=tuner["epochs"],
                    batch_size=tuner["batch"],
                    validation_split=0.2,
                    verbose=0,
                )
            except Exception as e:  # reported under the table; the others still run
                traceback.print_exc()
                _emit({"kind": "tuner-note", "text": f"{name} failed: {type(e).__name__}: {e}"})
                continue
            seconds = time.perf_counter() - start
            per_trial[method] = seconds / trials
            done = [t for t in search.oracle.trials.values() if t.status == "COMPLETED"]
            _emit(
                {
                    "kind": "tuner",
                    "method": method,
                    "trials": trials,
                    "seconds": seconds,
                    "completed": len(done),
                    **_compiled_figures(compiled),
                }
            )
    finally:
        tuner_log.removeHandler(handler)
        shutil.rmtree(root, ignore_errors=True)
    return 0


# --------------------------------------------------------------------------- the table


def _spread(values: list[float], digits: int = 2, thousands: bool = False) -> str:
    fmt = f"{{:,.{digits}f}}" if thousands else f"{{:.{digits}f}}"
    middle = fmt.format(statistics.median(values))
    if len(values) < 2:
        return middle
    return f"{middle} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _percent(values: list[float | None]) -> str:
    values = [v for v in values if v is not None and v == v]
    return f"{statistics.median(values):.1f}" if values else "-"


def _runs(records: list[dict], kind: str, n: int | None = None) -> list[dict]:
    return [r for r in records if r["kind"] == kind and (n is None or r.get("n") == n)]


def _tuner_section_estimate(tuner: dict[str, Any]) -> float:
    """Seconds the tuner section's plain and default-executor searches should take, with its
    start, from the a priori guesses (the pack searches run only as they fit)."""
    searches = [s for s in _tuner_searches(tuner) if s[0] not in ("pack", "devices")]
    start = tuner["guess_s"]["start"]
    return start + sum(_tuner_estimate(tuner, m, t, {}) for m, t in searches)


def format_table(records: list[dict], sizes: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown table of the records measured so far (medians [min-max] over repeats)."""
    env: dict[str, Any] = {}
    for r in _runs(records, "env"):
        env.update(r)
    warmup, epochs, samples = sizes["warmup"], sizes["epochs"], sizes["samples"]
    repeats = sorted({r["repeat"] for r in records if "repeat" in r})
    lines = [
        f"GPU table ({meta['mode']}): Keras {env.get('keras', '?')} on "
        f"{env.get('backend', '?')} {env.get('jax', '?')} ({env.get('jax_device', '?')}); "
        f"torch {env.get('torch', '-')} ({env.get('torch_device', '-')}); "
        f"{meta.get('gpu') or 'nvidia-smi: none'}",
        "",
        f"The seeds' MLP (10-64-32-1, Adam, batch {_BATCH}), {samples:,} samples x {epochs} "
        f"epochs; steady: median of epochs {warmup + 1}-{epochs}; {len(repeats)} repeat(s), "
        "median [min-max] over a row's own. End to end: `ModelPack(members)` (plain: "
        "`compile`) to the end of `fit`, tracing and compiling included.",
        "",
        "| N | method | end to end s | x seq | steady epoch s | steady model-samples/s | "
        "x seq | GPU util % | SM active % |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    plain = _runs(records, "plain")
    one_fit_s = [statistics.mean(f["e2e_s"] for f in r["fits"]) for r in plain]
    plain_steady = [
        statistics.median(_steady(f["epoch_s"], warmup) for f in r["fits"]) for r in plain
    ]
    plain_fits = [f for r in plain for f in r["fits"]]
    for n in sizes["members"]:
        base_e2e = base_rate = None
        if plain:
            e2e = [n * s for s in one_fit_s]
            rates = [samples / s for s in plain_steady]
            base_e2e, base_rate = statistics.median(e2e), statistics.median(rates)
            lines.append(
                f"| {n} | sequential ({sizes['sequential']} fits, scaled) | {_spread(e2e, 1)} | "
                f"1.00 | {_spread(plain_steady, 3)} | {_spread(rates, 0, True)} | 1.00 | "
                f"{_percent([f.get('util') for f in plain_fits])} | "
                f"{_percent([f.get('sm_active') for f in plain_fits])} |"
            )
        for kind, label in (("pack", "ModelPack"), ("torch", "torch-vmap")):
            runs = _runs(records, kind, n)
            if not runs:
                continue
            if kind == "pack":
                label += f" ({'/'.join(sorted({r['engine'] for r in runs}))})"
            else:
                label += f" (torch.func, {runs[0]['threads']} CPU thread)"
            e2e = [r["e2e_s"] for r in runs]
            steady = [_steady(r["epoch_s"], warmup) for r in runs]
            rates = [n * samples / s for s in steady]
            x_e2e = f"{base_e2e / statistics.median(e2e):.2f}" if base_e2e else "-"
            x_rate = f"{statistics.median(rates) / base_rate:.2f}" if base_rate else "-"
            lines.append(
                f"| {n} | {label} | {_spread(e2e, 1)} | {x_e2e} | {_spread(steady, 3)} | "
                f"{_spread(rates, 0, True)} | {x_rate} | "
                f"{_percent([r.get('util') for r in runs])} | "
                f"{_percent([r.get('sm_active') for r in runs])} |"
            )
    lines += [
        "",
        "One-time cost: end to end less epochs x the steady epoch (what is paid once: "
        "tracing, compiling, the first and last batch shapes).",
        "",
        "| members | building s | one-time s | vs one plain model | steady epoch s | engine |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    firsts = [r["fits"][0] for r in plain]
    plain_once = [f["e2e_s"] - epochs * _steady(f["epoch_s"], warmup) for f in firsts]
    if firsts:
        lines.append(
            f"| plain model | {_spread([f['build_s'] for f in firsts])} | "
            f"{_spread(plain_once)} | 1.0x | "
            f"{_spread([_steady(f['epoch_s'], warmup) for f in firsts], 3)} | plain |"
        )
    for n in [1, *sizes["members"]]:
        runs = _runs(records, "pack", n)
        if not runs:
            continue
        once = [r["e2e_s"] - epochs * _steady(r["epoch_s"], warmup) for r in runs]
        ratio = f"{statistics.median(once) / statistics.median(plain_once):.1f}x" if firsts else "-"
        lines.append(
            f"| {n} | {_spread([r['build_s'] for r in runs])} | {_spread(once)} | {ratio} | "
            f"{_spread([_steady(r['epoch_s'], warmup) for r in runs], 3)} | "
            f"{'/'.join(sorted({r['engine'] for r in runs}))} |"
        )
    notes = list(meta.get("notes", []))
    monitor_s = [r["monitor_s"] for r in _runs(records, "pack") if "monitor_s" in r]
    monitor_s += [f["monitor_s"] for f in plain_fits if "monitor_s" in f]
    if monitor_s:
        notes.append(
            f"UtilizationLogger started and stopped in {_spread(monitor_s)} s a fit, left out "
            "of end to end; its figures are the steady epochs' means (torch: the whole run, "
            "from the monitor's sampler). GPU util: share of time a kernel ran; SM active: "
            "share of SMs busy (NVML GPM, Hopper)."
        )
    for r in _runs(records, "monitor"):
        if r["unavailable"]:
            notes.append(f"GPU utilisation not measured: {r['unavailable']}.")
            break
        fits = _runs(records, "pack") + plain_fits
        if fits and all(f.get("util") is None for f in fits):
            notes.append("UtilizationLogger gave no GPU figures: see its warning in the log.")
            break
    if plain:
        notes.append(
            f"Sequential: {sizes['sequential']} plain fits per repeat, their mean time scaled "
            "to N members (a plain fit costs the same whatever N). The Keras rows of a repeat "
            "ran in one process in rotated order after a warm-up fit of other shapes."
        )
    if _runs(records, "torch"):
        notes.append(
            "torch-vmap: end to end is its whole run (the modules built and stacked on the "
            "device, then every epoch; eager, nothing to compile), after a warm-up run."
        )
    notes += [f"{r['what']}: {r['why']}." for r in _runs(records, "skip")]
    notes += [f"{r['what']} failed: {r['error']}" for r in _runs(records, "error")]
    if notes:
        lines += [""] + [f"- {note}" for note in dict.fromkeys(notes)]
    lines += _large_lines(records, sizes)
    lines += _tuner_lines(records, sizes["tuner"])
    return "\n".join(lines) + "\n"


def _kernels(counts: dict[str, int]) -> str:
    fusions, calls = counts["fusions"], counts["custom_calls"]
    return f"{fusions + calls} ({fusions} + {calls})"


def _large_lines(records: list[dict], sizes: dict[str, Any]) -> list[str]:
    """The large packs' table, once one was measured or skipped, and its notes."""
    runs, notes = _runs(records, "large"), [r["text"] for r in _runs(records, "large-note")]
    if not runs and not notes:
        return []
    warmup, samples, large = sizes["warmup"], sizes["samples"], sizes["large"]
    lines = [
        "",
        f"Large packs, one run each: the same MLP, {samples:,} samples x {large['epochs']} "
        "epochs. Kernels: the XLA fusions + custom calls (cuBLAS matmuls on a GPU) of the "
        "compiled one-batch training step, the launches a step costs.",
        "",
        "| N | end to end s | steady epoch s | steady model-samples/s | vs ModelPack N=64 | "
        "kernels of the step | GPU util % | SM active % |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = _runs(records, "pack", 64)
    base_rate = None
    if base:
        base_rate = statistics.median(64 * samples / _steady(r["epoch_s"], warmup) for r in base)
    for r in _runs(records, "large-reference"):
        lines.append(f"| 1 | - | - | - | - | {_kernels(r['kernels'])} | - | - |")
    for r in runs:
        steady = _steady(r["epoch_s"], warmup)
        rate = r["n"] * samples / steady
        ratio = f"{rate / base_rate:.2f}" if base_rate else "-"
        lines.append(
            f"| {r['n']} | {r['e2e_s']:.1f} | {steady:.3f} | {rate:,.0f} | {ratio} | "
            f"{_kernels(r['kernels'])} | {_percent([r.get('util')])} | "
            f"{_percent([r.get('sm_active')])} |"
        )
    return lines + ([""] + [f"- {note}" for note in notes] if notes else [])


def _tuner_lines(records: list[dict], tuner: dict[str, Any]) -> list[str]:
    """The tuner section: its table, once a search was measured, and its notes."""
    runs = _runs(records, "tuner")
    notes = [r["text"] for r in _runs(records, "tuner-note")]
    if not runs:
        return ["", "Tuner table:", ""] + [f"- {note}" for note in notes] if notes else []
    lines = [
        "",
        f"Tuner: KerasTuner's getting-started space (benchmarks/_tuner_spaces.py: 1-3 Dense "
        f"layers of 32-256 units, relu or tanh, dropout or not, Adam or SGD), RandomSearch "
        f"seed 1; {tuner['samples']:,} MNIST-shaped samples x {tuner['epochs']} epochs, batch "
        f"{tuner['batch']}, validation split 0.2. Wall seconds of `search`, one run each in "
        "one process after a warm-up fit; vs plain: plain KerasTuner's time over the method's.",
    ]
    plain = [r for r in runs if r["method"] == "plain"]
    per_trial = plain[0]["seconds"] / plain[0]["trials"] if plain else None
    rows = []
    for trials in tuner["trials"]:
        if per_trial is not None:
            sample = plain[0]["trials"]
            label = _TUNER_NAMES["plain"]
            if sample != trials:
                label += f" ({sample} trials, scaled)"
            completed = plain[0]["completed"]
            rows.append(
                f"| {trials} | {label} | {per_trial * trials:.1f} | 1.00x | "
                f"{completed if sample == trials else f'{completed} of {sample}'} | {trials} | - |"
            )
        for r in runs:
            if r["method"] == "plain" or r["trials"] != trials:
                continue
            ratio = f"{per_trial * trials / r['seconds']:.2f}x" if per_trial else "-"
            padding = f"{r['padding']}%" if "padding" in r else "-"
            rows.append(
                f"| {trials} | {_TUNER_NAMES[r['method']]}, K={tuner['parallel_trials']} | "
                f"{r['seconds']:.1f} | {ratio} | {r['completed']} | "
                f"{r.get('programs', '-')} | "
                f"{padding} |"
            )
    if rows:
        lines += [
            "",
            "| trials | method | wall s | vs plain | trials completed | programs | padding |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
            *rows,
        ]
    if plain and plain[0]["trials"] not in tuner["trials"]:
        notes.insert(
            0,
            f"Plain KerasTuner ran its first {plain[0]['trials']} trials (the same as every "
            f"search's first {plain[0]['trials']}, seed 1): {per_trial:.2f} s a trial, scaled "
            "to each trial count.",
        )
    if notes:
        lines += [""] + [f"- {note}" for note in notes]
    return lines


# --------------------------------------------------------------------------- the driver


class _Driver:
    """Runs the workers repeat by repeat, echoes each measurement and keeps the table."""

    def __init__(self, args: argparse.Namespace, sizes: dict[str, Any], log: Any) -> None:
        self.args, self.sizes, self.log = args, sizes, log
        self.records: list[dict] = []
        self.notes: list[str] = []
        self.start = time.monotonic()
        self.gpu = _nvidia_smi()
        self.fatal: str | None = None

    def say(self, text: str) -> None:
        print(text, flush=True)
        if self.log:
            self.log.write(text + "\n")

    def write_table(self) -> str:
        meta = {
            "mode": "CPU smoke run, tiny sizes" if self.args.cpu_smoke else "GPU",
            "gpu": self.gpu,
            "notes": self.notes,
        }
        table = format_table(self.records, self.sizes, meta)
        if self.args.out:
            with open(self.args.out, "w") as f:
                f.write(table)
        return table

    def run(self) -> int:
        self.say(f"gpu_table: sizes {json.dumps(self.sizes)}; {self.gpu or 'no nvidia-smi'}")
        durations: dict[str, float] = {}
        torch_skipped = False
        for repeat in range(self.sizes["repeats"]):
            order = ["jax", "torch"] if repeat % 2 == 0 else ["torch", "jax"]
            ran = False
            for kind in order:
                if kind == "torch" and torch_skipped:
                    continue
                left = self.sizes["budget"] - (time.monotonic() - self.start)
                if kind in durations and 1.1 * durations[kind] > left:
                    self.notes.append(
                        f"repeat {repeat + 1}: the {kind} worker was not started (its last "
                        f"run took {durations[kind]:.0f} s, {left:.0f} s of the "
                        f"{self.sizes['budget']:.0f} s budget left)"
                    )
                    continue
                began, first = time.monotonic(), len(self.records)
                self._worker(kind, repeat)
                durations[kind], ran = time.monotonic() - began, True
                new = self.records[first:]
                torch_skipped = torch_skipped or any(r["kind"] == "skip" for r in new)
                if self.fatal:
                    self.say(f"gpu_table: {self.fatal}")
                    return 2
            if not ran:
                break
            self.say(f"\n== after repeat {repeat + 1} ({time.monotonic() - self.start:.0f} s)")
            self.say(self.write_table())
            if repeat == 0:
                self._large()
                self._tuner()
        self.say(f"gpu_table: done in {time.monotonic() - self.start:.0f} s")
        self.write_table()
        return 0

    def _tuner(self) -> None:
        """The tuner section, when its plain and default-executor searches' estimate fits the
        budget; it gets at most `cap_s` seconds of what is left."""
        tuner = self.sizes["tuner"]
        left = self.sizes["budget"] - (time.monotonic() - self.start)
        estimate = _tuner_section_estimate(tuner)
        if estimate > left:
            text = (
                "The tuner table was not measured: its plain and default-executor searches' "
                f"estimate, "
                f"{estimate:.0f} s, exceeds the {left:.0f} s left of the "
                f"{self.sizes['budget']:.0f} s budget."
            )
            self.records.append({"kind": "tuner-note", "text": text})
            self.say(f"gpu_table: {text}")
            return
        self._worker("tuner", 0, {**tuner, "deadline": time.time() + min(tuner["cap_s"], left)})
        self.say(f"\n== after the tuner searches ({time.monotonic() - self.start:.0f} s)")
        self.say(self.write_table())

    def _large(self) -> None:
        """The large packs, once, when their a priori estimate fits what is left of the
        budget less the tuner section's estimate; at most `guess_s` x 2 seconds."""
        large, tuner = self.sizes["large"], self.sizes["tuner"]
        left = self.sizes["budget"] - (time.monotonic() - self.start)
        after = _tuner_section_estimate(tuner)
        if large["guess_s"] > left - after:
            text = (
                f"The large packs were not measured: their estimate, {large['guess_s']:.0f} s, "
                f"and the tuner section's, {after:.0f} s, exceed the {left:.0f} s left."
            )
            self.records.append({"kind": "large-note", "text": text})
            self.say(f"gpu_table: {text}")
            return
        deadline = time.time() + min(2 * large["guess_s"], left - after)
        self._worker("large", 0, sizes={**self.sizes, "large": {**large, "deadline": deadline}})
        self.say(f"\n== after the large packs ({time.monotonic() - self.start:.0f} s)")
        self.say(self.write_table())

    def _worker(
        self,
        kind: str,
        repeat: int,
        tuner: dict[str, Any] | None = None,
        sizes: dict[str, Any] | None = None,
    ) -> None:
        left = self.sizes["budget"] - (time.monotonic() - self.start)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
        if kind == "torch":
            env["JAX_PLATFORMS"] = "cpu"  # keras_gpushare's import keeps off the GPU there
        if self.args.cpu_smoke:
            env["JAX_PLATFORMS"] = "cpu"
            env["CUDA_VISIBLE_DEVICES"] = ""  # torch too
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            kind,
            "--repeat",
            str(repeat),
            "--sizes",
            json.dumps({**(sizes or self.sizes), "tuner": tuner or self.sizes["tuner"]}),
        ] + (["--cpu-smoke"] if self.args.cpu_smoke else [])
        if kind in ("tuner", "large"):
            what = f"the {kind} worker"
            self.say(f"-- {kind} worker ({left:.0f} s of budget left)")
        else:
            what = f"repeat {repeat + 1}: the {kind} worker"
            self.say(f"-- repeat {repeat + 1}: {kind} worker ({left:.0f} s of budget left)")
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        reader = threading.Thread(
            target=self._read, args=(process,), name=f"gpu-table-{kind}", daemon=True
        )
        reader.start()
        try:
            process.wait(timeout=max(left, 5.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            self._note(kind, f"{what} was stopped at the budget")
        reader.join(timeout=10.0)
        if process.returncode and not self.fatal:
            self._note(kind, f"{what} exited with {process.returncode} (see the log)")

    def _note(self, kind: str, text: str) -> None:
        """A note under the first table, or under the tuner table for the tuner worker's."""
        if kind in ("tuner", "large"):
            self.records.append({"kind": f"{kind}-note", "text": text[0].upper() + text[1:]})
        else:
            self.notes.append(text)

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            line = line.rstrip("\n")
            if not line.startswith(_RESULT):
                if self.log:
                    self.log.write(f"   | {line}\n")
                continue
            record = json.loads(line[len(_RESULT) :])
            if self.log:
                self.log.write(f"   > {json.dumps(record)}\n")  # every epoch's seconds
            self.records.append(record)
            self.say(f"   {_summary(record, self.sizes)}")
            if record["kind"] == "fatal":
                self.fatal = record["error"]
            self.write_table()


def _summary(record: dict[str, Any], sizes: dict[str, Any]) -> str:
    """One line per measurement, printed as soon as it is taken."""
    kind, warmup = record["kind"], sizes["warmup"]

    def fit(r: dict[str, Any], n: int) -> str:
        steady = _steady(r["epoch_s"], warmup)
        text = (
            f"end to end {r['e2e_s']:.2f} s, steady {steady:.3f} s/epoch "
            f"({n * sizes['samples'] / steady:,.0f} model-samples/s)"
        )
        if r.get("util") is not None:
            text += f", GPU util {r['util']:.0f}%"
        return text

    if kind == "plain":
        return "plain fits: " + "; ".join(fit(f, 1) for f in record["fits"])
    if kind == "pack":
        return f"ModelPack N={record['n']} ({record['engine']}): {fit(record, record['n'])}"
    if kind == "torch":
        return f"torch-vmap N={record['n']}: {fit(record, record['n'])}"
    if kind == "large":
        kernels = _kernels(record["kernels"])
        return f"large ModelPack N={record['n']}: {fit(record, record['n'])}, kernels {kernels}"
    if kind == "large-reference":
        return f"ModelPack N=1 step: kernels {_kernels(record['kernels'])}"
    if kind == "tuner":
        return (
            f"{_TUNER_NAMES[record['method']]}, {record['trials']} trials: "
            f"{record['seconds']:.1f} s ({record['completed']} completed)"
        )
    if kind in ("tuner-note", "large-note"):
        return f"{kind[:-5]}: {record['text']}"
    return f"{kind}: " + ", ".join(f"{k}={v}" for k, v in record.items() if k != "kind")


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"nvidia-smi: {out.splitlines()[0]}" if out else None


def _members(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected comma-separated member counts of 2 or more, e.g. 16,64."
        )
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, on the CPU")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument("--log", default=None, help="append the full log (workers') here")
    parser.add_argument("--members", type=_members, default=None, help="e.g. 16,64")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--budget", type=float, default=None, help="seconds for all runs")
    parser.add_argument("--sequential-at-most", type=int, default=None, dest="sequential")
    parser.add_argument(
        "--worker", choices=("jax", "torch", "tuner", "large"), help=argparse.SUPPRESS
    )
    parser.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sizes = json.loads(args.sizes)
        worker = {
            "jax": _jax_worker,
            "torch": _torch_worker,
            "tuner": _tuner_worker,
            "large": _large_worker,
        }[args.worker]
        return worker(sizes, args.repeat, args.cpu_smoke)
    sizes = dict(_SMOKE if args.cpu_smoke else _GPU)
    for key in ("members", "samples", "repeats", "budget", "sequential"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if min(sizes["samples"], sizes["repeats"], sizes["sequential"]) < 1:
        parser.error("--samples, --repeats and --sequential-at-most must be positive.")
    if sizes["epochs"] <= sizes["warmup"]:
        parser.error("no steady epoch: epochs must exceed the warm-up.")
    if not args.log:
        return _Driver(args, sizes, None).run()
    with open(args.log, "a", buffering=1) as log:
        return _Driver(args, sizes, log).run()


if __name__ == "__main__":
    sys.exit(main())
