"""Benchmark: a KerasTuner search, plain KerasTuner vs ParallelTuner, in one run.

Every method runs the same search (RandomSearch, or Hyperband with `--oracle hyperband`;
same seed, so the same hyperparameter sets) for the same epochs on the same data: plain
KerasTuner one trial after the other; ParallelTuner with executor="pack" at K=4, 8, 16 trials
per pack; with executor="slots" at K=8, 16 slots (`--slots`); with executor="processes" and
2 workers; with `--devices 1,2`, one and two device workers (`ParallelTuner(devices=...)`:
GPUs, or CPU workers on a machine without GPUs), each `--device-trials` trials at a time.
Three search spaces:

- `small` (default): one hidden layer of 32/64/128 units, dropout rate, log learning rate.
- `depths`: issue 58's space on the `small` data: 1-3 layers of 16-128 units (step 16),
  relu or tanh, Adam or SGD with momentum, log learning rate.
- `getting-started`: KerasTuner's getting-started space on MNIST-shaped synthetic data
  (flatten, 1-3 layers of 32-256 units step 32, relu or tanh, dropout on or off, softmax over
  10 classes, log learning rate, Adam or SGD): trials differ in widths, depth, activation and
  optimizer family, which the pack fuses with padding.

They live in benchmarks/_tuner_spaces.py, which gpu_table.py imports too (without TensorFlow).

Prints wall time, the ratio of plain KerasTuner's time to each method's (same run), the
best and worst trial scores, and for pack methods the engines the packs trained on and
the search's own log line (programs compiled, probe builds of the space and their seconds,
the share of the FLOPs that trained no trial).

With `--bound`, each pack and slots method also prints where its time went, from timings of
every pack it trained (`ModelPack()`, `compile`, and `fit` epoch by epoch, read through a
callback the benchmark adds to each pack; for slots, each program): packs, each pack's fixed
cost (building and compiling it, its first epoch beyond a steady one, and `fit`'s time
outside epochs), the steady epochs, and "one program": the ratio the search would reach if
every pack after the first cost only its steady epochs, as a search streaming its trials
through one compiled program (slots) would at best on this machine, padding and refilling
slots taken as free. Then "padding-free": the steady epochs if each trial's epochs cost only
its own FLOPs, each steady epoch of a pack scaled by the FLOPs of the models its active
slots held over the FLOPs the pack computes (each fused group padded to its widest, every
slot of a program, free or not; counted per sample by the planner's cost model,
keras_gpushare/pack/fusion/cost.py), the measured steady epochs as a multiple of it, and
the ratio with no padding and one program's fixed cost.

    python benchmarks/tuner.py [--space small|getting-started] [--quick] [--trials 16]
        [--epochs 5] [--packs 4,8,16] [--slots 8,16] [--oracle random|hyperband] [--bound]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import re
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_tuner  # noqa: E402
import numpy as np  # noqa: E402
from _tuner_spaces import SPACES, make_data  # noqa: E402

import keras_gpushare as kg  # noqa: E402
from keras_gpushare.pack.program import computed_flops, own_flops  # noqa: E402

DEVICES = kg.share_gpu()  # memory growth: the processes executor's workers share the GPU


class _Engines(logging.Handler):
    """Collects the engines ParallelTuner's packs report ("... (fused engine)")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.engines: collections.Counter = collections.Counter()
        self.summary = ""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Search:"):
            self.summary = record.getMessage()
        match = re.search(
            r"(?:one pack of|in) (\d+) (?:models|slots) \((\w+) engine\)", record.getMessage()
        )
        if match:
            self.engines[match.group(2)] += int(match.group(1))


class _PackClock(keras.callbacks.Callback):
    """Times one pack's `fit`, epoch by epoch, and notes the models its active slots hold
    in each epoch (a slot's member, or the model last loaded into it)."""

    def __init__(self, record: dict) -> None:
        super().__init__()
        self.record = record

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        slots, status = self.record["slots"], self.model.status
        self.record["trained"].append([m for m, s in zip(slots, status) if s == "active"])
        self._begin = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.record["epochs"].append(time.perf_counter() - self._begin)


@contextlib.contextmanager
def _timed_packs(packs: list):
    """Appends a record of each `ModelPack` built inside: its build, compile, fit and epochs,
    its engine plan, the model each slot holds, and the models trained in each epoch."""
    pack_class = kg.ModelPack
    names = ("__init__", "compile", "fit", "load_member")
    originals = {name: getattr(pack_class, name) for name in names}
    records: dict[int, dict] = {}  # by id of a live pack

    def timed(name):
        method = originals[name]

        def call(self, *args, **kwargs):
            if name == "__init__":
                members = list(args[0] if args else kwargs["members"])
                records[id(self)] = {
                    "members": len(members),
                    "built": members,
                    "slots": list(members),
                    "build": 0.0,
                    "compile": 0.0,
                    "fit": 0.0,
                    "epochs": [],
                    "trained": [],
                }
                packs.append(records[id(self)])
            record = records[id(self)]
            if name == "load_member":
                index = args[0] if args else kwargs["index"]
                model = args[1] if len(args) > 1 else kwargs["model"]
                record["slots"][index] = model
                return method(self, *args, **kwargs)
            if name == "fit":
                kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), _PackClock(record)]
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                key = {"__init__": "build"}.get(name, name)
                record[key] += time.perf_counter() - start
                if name == "compile":
                    record["plan"] = self.engine_plan

        return call

    for name in names:
        setattr(pack_class, name, timed(name))
    try:
        yield packs
    finally:
        for name, method in originals.items():
            setattr(pack_class, name, method)


def _where_time_went(packs: list, seconds: float, plain: float, word: str) -> str:
    """Packs' fixed cost and steady epochs, the ratio with one program, and the steady epochs
    with no padding (see `--bound`).

    A pack of one epoch has no steady epoch of its own: it is taken at the median rate a
    member-epoch of the multi-epoch packs ran at. An epoch without padding takes the pack's
    steady epoch x the FLOPs of the models its active slots held over the FLOPs the pack
    computes.
    """
    own = [float(np.median(r["epochs"][1:])) if len(r["epochs"]) > 1 else None for r in packs]
    rates = [usual / r["members"] for usual, r in zip(own, packs) if usual is not None]
    rate = float(np.median(rates)) if rates else 0.0
    fixed, steady, padding_free, flops = [], 0.0, 0.0, {}
    for usual, record in zip(own, packs):
        epoch = rate * record["members"] if usual is None else usual
        steady += len(record["epochs"]) * epoch
        fixed.append(
            record["build"] + record["compile"] + record["fit"] - len(record["epochs"]) * epoch
        )
        computed = computed_flops(record["plan"], record["built"])
        for model in (m for models in record["trained"] for m in models):
            if id(model) not in flops:
                flops[id(model)] = own_flops(model)
        trained = [flops[id(m)] for models in record["trained"] for m in models]
        if computed is None or None in trained:
            padding_free = None
        elif padding_free is not None:
            padding_free += epoch * sum(trained) / computed
    one_program = seconds - sum(fixed) + max(fixed, default=0.0)
    lines = [
        f"{'':<22}{len(packs)} {word}{'' if len(packs) == 1 else 's'}: fixed {sum(fixed):.1f} s "
        f"({', '.join(f'{f:.1f}' for f in fixed)}), steady epochs {steady:.1f} s, "
        f"rest {seconds - sum(fixed) - steady:.1f} s; one program {one_program:.1f} s, "
        f"{plain / one_program:.2f}x"
    ]
    if padding_free is None:
        lines.append(f"{'':<22}padding-free: not estimated (a model that does not fuse)")
    elif padding_free > 0:
        both = one_program - steady + padding_free
        lines.append(
            f"{'':<22}padding-free steady epochs {padding_free:.1f} s (measured: "
            f"{steady / padding_free:.2f}x it); one program, padding-free {both:.1f} s, "
            f"{plain / both:.2f}x"
        )
    return "\n".join(lines)


def run(method: str, k: int, args: argparse.Namespace, data: tuple, root: str) -> tuple:
    """Runs one search; returns (seconds, scores of the completed trials)."""
    common = dict(directory=root, project_name=f"{method}-{k}", overwrite=True)
    hypermodel = SPACES[args.space]
    if args.oracle == "hyperband":
        # Hyperband's epochs come from its brackets: max_epochs=args.epochs, factor 3.
        oracle_args = dict(objective="val_loss", max_epochs=args.epochs, factor=3, seed=1)
        if method == "plain":
            tuner = keras_tuner.Hyperband(hypermodel, **oracle_args, **common)
        else:
            oracle = keras_tuner.oracles.HyperbandOracle(**oracle_args)
            tuner = kg.tuner.ParallelTuner(
                hypermodel, oracle=oracle, parallel_trials=k, executor=method, **common
            )
    elif method == "plain":
        tuner = keras_tuner.RandomSearch(
            hypermodel, objective="val_loss", max_trials=args.trials, seed=1, **common
        )
    elif method == "devices":
        # k workers, one per device (GPUs where there are, else CPU workers), each
        # training --device-trials trials at a time with the default executor.
        gpu = "GPU" in str(DEVICES[0]).upper()
        tuner = kg.tuner.ParallelTuner(
            hypermodel,
            objective="val_loss",
            max_trials=args.trials,
            seed=1,
            parallel_trials=args.device_trials,
            devices=[str(i) if gpu else f"cpu{i}" for i in range(k)],
            **common,
        )
    else:
        tuner = kg.tuner.ParallelTuner(
            hypermodel,
            objective="val_loss",
            max_trials=args.trials,
            seed=1,
            parallel_trials=k,
            executor=method,
            **common,
        )
    x, y = data
    start = time.perf_counter()
    tuner.search(x, y, epochs=args.epochs, batch_size=args.batch, validation_split=0.2, verbose=0)
    seconds = time.perf_counter() - start
    scores = [t.score for t in tuner.oracle.trials.values() if t.status == "COMPLETED"]
    return seconds, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--space", choices=sorted(SPACES), default="small")
    parser.add_argument("--quick", action="store_true", help="4 trials, 2 epochs, K=4 only")
    parser.add_argument(
        "--oracle",
        choices=("random", "hyperband"),
        default="random",
        help="RandomSearch (--trials trials) or Hyperband (max_epochs=--epochs, factor 3)",
    )
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--packs", default="4,8,16", help="pack sizes K to run")
    parser.add_argument(
        "--slots", default="8,16", help='slot counts K of executor="slots" to run ("" for none)'
    )
    parser.add_argument("--workers", type=int, default=2, help="processes executor workers")
    parser.add_argument(
        "--devices",
        default="",
        help="worker counts of ParallelTuner(devices=...) to run, e.g. 1,2: one worker per "
        "GPU, or CPU workers on a machine without GPUs",
    )
    parser.add_argument(
        "--device-trials", type=int, default=8, help="parallel_trials of each device's worker"
    )
    parser.add_argument(
        "--bound",
        action="store_true",
        help="print each pack method's fixed and steady time, and its ratio with one program",
    )
    args = parser.parse_args()
    if args.quick:
        args.trials, args.epochs, args.packs, args.samples = 4, 2, "4", 1024
        args.slots = "4" if args.slots else ""
    data = make_data(args.samples, args.space)
    methods = [("plain", 1)]
    methods += [("pack", int(k)) for k in args.packs.split(",") if k]
    methods += [("slots", int(k)) for k in args.slots.split(",") if k]
    if args.workers:
        methods.append(("processes", args.workers))
    methods += [("devices", int(n)) for n in args.devices.split(",") if n]
    root = tempfile.mkdtemp(prefix="kg-tuner-bench-")
    search = (
        f"Hyperband, max_epochs {args.epochs}"
        if args.oracle == "hyperband"
        else f"{args.trials} trials x {args.epochs} epochs"
    )
    print(
        f"space {args.space}: {search}, {args.samples} "
        f"samples, batch {args.batch}, device: {DEVICES[0]}"
    )
    print(
        f"{'method':<22}{'wall s':>9}{'vs plain':>10}{'best':>9}{'worst':>9}{'trials':>8}"
        "  members per engine"
    )
    engines = _Engines()
    pack_logger = logging.getLogger("keras_gpushare.tuner")
    pack_logger.addHandler(engines)
    pack_logger.setLevel(logging.INFO)
    baseline = None
    try:
        for method, k in methods:
            engines.engines.clear()
            engines.summary = ""
            packs: list = []
            timed = args.bound and method in ("pack", "slots")
            with _timed_packs(packs) if timed else contextlib.nullcontext():
                seconds, scores = run(method, k, args, data, root)
            baseline = baseline or seconds
            plain = "KerasTuner " + ("Hyperband" if args.oracle == "hyperband" else "RandomSearch")
            name = plain if method == "plain" else f"{method} K={k}"
            if method == "devices":
                name = f"devices {k}x K={args.device_trials}"
            used = ", ".join(f"{e} {n}" for e, n in sorted(engines.engines.items()))
            print(
                f"{name:<22}{seconds:>9.1f}{baseline / seconds:>9.2f}x"
                f"{min(scores):>9.4f}{max(scores):>9.4f}{len(scores):>8}  {used}",
                flush=True,
            )
            if engines.summary:
                print(f"{'':<22}{engines.summary}", flush=True)
            if packs:
                word = "program" if method == "slots" else "pack"
                print(_where_time_went(packs, seconds, baseline, word), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
