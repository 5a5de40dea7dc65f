"""Short fits: does a pack with default arguments beat sequential fits end to end?

XLA speeds up the fused engine's steady step but costs seconds to compile, which a short
`fit` may never earn back; the graph engine's one traced step must pay for itself over a few
members. For each case this trains the members as plain sequential fits and as one
`ModelPack` with `jit_compile=False`, `True` and the default (`"auto"`), each run in a fresh
process, the runs interleaved over the repeats, and prints per method the medians [min-max]
over the repeats of: end-to-end seconds (building, compiling and fitting), the seconds after
building (`ModelPack` + `compile` + `fit` against the plain `compile` + `fit` calls: the
members' own building left out on both sides), the first epoch (tracing and compiling) and a
steady epoch (median of the later ones), with the sequential fits' figure over the method's
(the speedup). The backend is `KERAS_BACKEND`'s (TensorFlow when unset); a pack the backend
refuses (graph-engine members off TensorFlow) is reported with the reason instead of figures.

Cases:
    mixed4, mixed20: 8 MLPs of different widths (16/32/48/64), depths (1-3 hidden layers)
        and activations (relu/tanh), on digits-sized data (1,797 samples, 64 features, 10
        classes), batch 32, 4 and 20 epochs.
    custom2, custom5: the first 2 or 5 of those MLPs with a small custom layer (a learned
        per-feature scale, which the fuser does not take) after the first hidden layer, so
        `fuse="auto"` trains them on the graph engine; same data, 4 epochs; sequential fits
        against the default pack only (the graph engine follows Keras's XLA rule).
    seeds: the seeds' MLP (10-64-32-1) x 16, batch 32, 2 epochs of 25,000 samples.
    seeds10: the same for 10 epochs, where XLA pays on a CPU (not run by default).

The pack-auto row's note says what the default did (`policy payback, switched to XLA`, or
the engine). On TensorFlow, the last line of a fused case derives what
`_jit_policy.PaybackCosts` assumes: XLA's steady speedup, and its compile time per batch
shape per second of tracing the plain step.

    python benchmarks/short_fit.py [--cases mixed4,mixed20,custom2,seeds] [--repeats 3]
        [--quick]
    KERAS_BACKEND=jax python benchmarks/short_fit.py --cases mixed4,custom2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from keras_gpushare._seeds_benchmark.measure import interleaved  # noqa: E402
from keras_gpushare._seeds_benchmark.workload import build_mlp, epoch_timer, make_data  # noqa: E402

METHODS = ("sequential", "pack-nojit", "pack-jit", "pack-auto")
_JIT = {"pack-nojit": False, "pack-jit": True, "pack-auto": "auto"}
_GRAPH_METHODS = ("sequential", "pack-auto")
CASES = {
    "mixed4": {"kind": "mixed", "members": 8, "samples": 1797, "epochs": 4},
    "mixed20": {"kind": "mixed", "members": 8, "samples": 1797, "epochs": 20},
    "custom2": {"kind": "custom", "members": 2, "samples": 1797, "epochs": 4},
    "custom5": {"kind": "custom", "members": 5, "samples": 1797, "epochs": 4},
    "seeds": {"kind": "seeds", "members": 16, "samples": 25_000, "epochs": 2},
    # Not run by default: a fit long enough for XLA to pay on a CPU.
    "seeds10": {"kind": "seeds", "members": 16, "samples": 25_000, "epochs": 10},
}
_DEFAULT_CASES = ("mixed4", "mixed20", "custom2", "seeds")
_QUICK_SEEDS_SAMPLES = 10_000


def _scale_layer():
    """A new instance of a small custom layer (a learned per-feature scale), which the
    fuser has no fused form for."""
    import keras

    class Scale(keras.layers.Layer):
        def build(self, input_shape):
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

        def call(self, inputs):
            return inputs * self.scale

    return Scale()


def _mixed_member(i: int, custom: bool = False):
    import keras

    keras.utils.set_random_seed(i)
    width = (16, 32, 48, 64)[i % 4]
    activation = ("relu", "tanh")[(i // 2) % 2]
    units = [width] + [32] * (i % 3)
    hidden = [keras.layers.Dense(n, activation=activation) for n in units]
    if custom:
        hidden.insert(1, _scale_layer())
    return keras.Sequential(
        [keras.Input((64,)), *hidden, keras.layers.Dense(10, activation="softmax")]
    )


def _workload(case: dict[str, Any]) -> tuple[Any, Any, list, str]:
    """Data, members and loss of a case."""
    if case["kind"] == "seeds":
        x, y = make_data(case["samples"])
        members = [build_mlp(64, seed=i) for i in range(case["members"])]
        return x, y, members, "binary_crossentropy"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(case["samples"], 64)).astype("float32")
    y = rng.integers(0, 10, size=(case["samples"],))
    custom = case["kind"] == "custom"
    members = [_mixed_member(i, custom) for i in range(case["members"])]
    return x, y, members, "sparse_categorical_crossentropy"


def _run(method: str, case: dict[str, Any]) -> dict[str, Any]:
    """One method on one case, in this (fresh) process: seconds end to end, of the first
    epoch and of a steady epoch (summed over the members for sequential fits)."""
    import keras_gpushare as kg

    start = time.perf_counter()
    x, y, members, loss = _workload(case)
    built = time.perf_counter()
    fit = {"batch_size": 32, "epochs": case["epochs"], "verbose": 0}
    note = ""
    if method == "sequential":
        ran = members[: case.get("sequential_at_most") or len(members)]
        first, steady = 0.0, 0.0
        for member in ran:
            member.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
            timer = epoch_timer()
            member.fit(x, y, callbacks=[timer], **fit)
            first += timer.times[0]
            steady += statistics.median(timer.times[1:] or timer.times)
        scale = len(members) / len(ran)
        if scale != 1:
            note = f"{len(ran)} of {len(members)} fits run, times scaled"
        end = time.perf_counter()
        return {
            "wall_s": (end - start) * scale,
            "fit_s": (end - built) * scale,
            "first_s": first * scale,
            "steady_s": steady * scale,
            "note": note,
        }
    try:
        pack = kg.ModelPack(members)
    except ValueError as error:  # graph-engine members off TensorFlow
        return {"refused": str(error).splitlines()[0]}
    pack.compile(optimizer="adam", loss=loss, metrics=["accuracy"], jit_compile=_JIT[method])
    timer = epoch_timer()
    pack.fit(x, y, callbacks=[timer], **fit)
    policy = getattr(pack, "_jit_policy", None)
    if method == "pack-auto":
        if policy is None:
            note = f"{pack.engine} engine, jit_compile resolved to {pack.jit_compile}"
        else:
            note = f"policy {policy.mode}" + (", switched to XLA" if policy.xla_function else "")
    end = time.perf_counter()
    return {
        "wall_s": end - start,
        "fit_s": end - built,
        "first_s": timer.times[0],
        "steady_s": statistics.median(timer.times[1:] or timer.times),
        "engine": pack.engine,
        "note": note,
    }


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def _report(name: str, case: dict[str, Any], results: dict[str, list[dict]]) -> str:
    import keras

    kind = {
        "mixed": f"{case['members']} mixed MLPs (widths 16-64, 1-3 hidden layers, "
        "relu/tanh), 64 features, 10 classes",
        "custom": f"{case['members']} mixed MLPs with a custom layer each, 64 features, 10 classes",
        "seeds": f"seeds' MLP 10-64-32-1 x {case['members']}",
    }[case["kind"]]
    refused = {m: rs for m, rs in results.items() if any("refused" in r for r in rs)}
    results = {m: rs for m, rs in results.items() if m not in refused}
    repeats = max(len(r) for r in results.values())
    lines = [
        f"{name} ({keras.backend.backend()}): {kind}, batch 32, {case['samples']} samples x "
        f"{case['epochs']} epochs; median [min-max] over {repeats} interleaved repeats; "
        "speedup = sequential / method",
        f"{'method':<11} {'end-to-end s':>20} {'after building s':>20} {'first epoch s':>20} "
        f"{'steady epoch s':>20} {'speedup e2e':>11} {'built':>6} {'first':>6} {'steady':>6}  note",
    ]
    keys = ("wall_s", "fit_s", "first_s", "steady_s")
    median = {
        m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in results.items() if rs
    }
    base = median.get("sequential")
    for method, runs in results.items():
        if not runs:
            continue
        cells = [_spread([r[k] for r in runs]) for k in keys]
        ratios = ["", "", "", ""]
        if base:
            ratios = [f"{base[k] / median[method][k]:.2f}x" for k in keys]
        notes = sorted({r.get("note", "") for r in runs} - {""})
        lines.append(
            f"{method:<11} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20} {cells[3]:>20} "
            f"{ratios[0]:>11} {ratios[1]:>6} {ratios[2]:>6} {ratios[3]:>6}  {'; '.join(notes)}"
        )
    for method, runs in refused.items():
        lines.append(f"{method:<11} refused: {runs[0]['refused']}")
    if keras.backend.backend() == "tensorflow" and {"pack-nojit", "pack-jit"} <= set(median):
        plain, xla = median["pack-nojit"], median["pack-jit"]
        trace = plain["first_s"] - plain["steady_s"]
        compile_s = (xla["first_s"] - xla["steady_s"]) - trace
        shapes = 1 if case["samples"] % 32 == 0 else 2
        lines.append(
            f"XLA: steady speedup {plain['steady_s'] / xla['steady_s']:.2f}x; trace "
            f"{trace:.2f} s (plain first epoch less a steady one); compile {compile_s:.2f} s "
            f"for {shapes} batch shape(s), {compile_s / max(trace, 1e-9) / shapes:.2f} s per "
            f"shape per second of tracing"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default=",".join(_DEFAULT_CASES), help="comma-separated, of " + ", ".join(CASES)
    )
    parser.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated, of {', '.join(METHODS)}; defaults to all of them, and to "
        f"{', '.join(_GRAPH_METHODS)} for the custom cases",
    )
    parser.add_argument("--epochs", type=int, default=None, help="override the cases' epochs")
    parser.add_argument("--repeats", type=int, default=None, help="defaults to 3 (1 with --quick)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"seeds case on {_QUICK_SEEDS_SAMPLES:,} samples, one repeat",
    )
    parser.add_argument(
        "--sequential-at-most",
        type=int,
        default=4,
        help="seeds case: run this many of the 16 sequential fits and scale (they cost the "
        "same per member); mixed cases always run all 8",
    )
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        if name not in CASES:
            parser.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")
        case = dict(CASES[name])
        if args.methods:
            methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        else:
            methods = list(_GRAPH_METHODS if case["kind"] == "custom" else METHODS)
        if args.epochs:
            case["epochs"] = args.epochs
        if case["kind"] == "seeds":
            case["sequential_at_most"] = args.sequential_at_most
            if args.quick:
                case["samples"] = _QUICK_SEEDS_SAMPLES
        results: dict[str, list[dict]] = {m: [] for m in methods}
        context = mp.get_context("spawn")
        for _, k in interleaved(len(methods), repeats):
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as executor:
                results[methods[k]].append(executor.submit(_run, methods[k], case).result())
        print(_report(name, case, results), flush=True)
        print(flush=True)


if __name__ == "__main__":
    main()
