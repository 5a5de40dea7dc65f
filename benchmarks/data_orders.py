"""What each trial's own data order costs a search (ParallelTuner, seeded builds).

A hypermodel that seeds each build (here from the trial's hyperparameters) gives every trial
of plain KerasTuner its own shuffled order; ParallelTuner then deals each member of a pack
or program its own rows (`data="shard"`, batches gathered from each trial's order). The
same search is run, in one process per run, interleaved over the repeats:

- `own orders`: `shuffle=True` (Keras's default), each trial on its own order;
- `one order`: `shuffle=False`, the trials on the data in order: the same work, batches
  shared by every member (what a search costs without the dealing);
- plain KerasTuner with `shuffle=True`, for the ratio a user sees.

Printed per method: the search's wall seconds, median [min-max] over the repeats, and the
ratio to `one order` (the cost of the own orders) and of plain KerasTuner to it.

    python benchmarks/data_orders.py [--executor pack|slots] [--trials 16] [--repeats 3]
    KERAS_BACKEND=jax python benchmarks/data_orders.py --executor slots
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _seeded(hp):
    """The small space's MLP, its build seeded from its hyperparameters."""
    import keras
    from _tuner_spaces import build

    keras.utils.set_random_seed(zlib.crc32(repr(sorted(hp.values.items())).encode()))
    return build(hp)


def _run(method: str, args: argparse.Namespace) -> float:
    import keras_tuner
    from _tuner_spaces import make_data

    import keras_gpushare as kg

    x, y = make_data(args.samples, "small")
    oracle = keras_tuner.oracles.RandomSearchOracle(
        objective="val_loss", max_trials=args.trials, seed=1
    )
    folder = tempfile.mkdtemp()
    if method == "keras-tuner":
        tuner = keras_tuner.Tuner(
            oracle=oracle, hypermodel=_seeded, directory=folder, project_name="p"
        )
    else:
        tuner = kg.tuner.ParallelTuner(
            oracle=oracle,
            hypermodel=_seeded,
            parallel_trials=args.k,
            executor=args.executor,
            directory=folder,
            project_name="p",
        )
    start = time.perf_counter()
    tuner.search(
        x,
        y,
        epochs=args.epochs,
        batch_size=args.batch,
        validation_split=0.2,
        shuffle=method != "one order",
        verbose=0,
    )
    return time.perf_counter() - start


METHODS = ("own orders", "one order", "keras-tuner")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", default="pack", choices=("pack", "slots"))
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--k", type=int, default=8, help="parallel_trials")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_run(args.one, args)))
        return 0
    times: dict[str, list[float]] = {method: [] for method in METHODS}
    for _ in range(args.repeats):
        for method in METHODS:
            command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--one", method]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            times[method].append(json.loads(out.strip().splitlines()[-1]))
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    print(
        f"backend {backend}, executor={args.executor}, K={args.k}, {args.trials} trials x "
        f"{args.epochs} epochs, {args.samples} samples, batch {args.batch}, seeded builds; "
        f"medians of {args.repeats} [min-max]"
    )
    print("| method | search s | vs one order |")
    print("| --- | ---: | ---: |")
    base = statistics.median(times["one order"])
    for method, values in times.items():
        median = statistics.median(values)
        print(
            f"| {method} | {median:.1f} [{min(values):.1f}-{max(values):.1f}] "
            f"| {median / base:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
