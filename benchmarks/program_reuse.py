"""Program reuse across packs: JAX's persistent compilation cache off and on, in one run.

A pack of N of the seeds' MLPs (new weights and learning rates each time, the same
architecture, shapes and batch size) is made, compiled and trained for one epoch R times in
one process, which is what a notebook cell run again or a search's rounds of one signature
do. Each configuration runs in a fresh process with `KERAS_BACKEND=jax`; the cache, when on,
starts empty in a temporary folder. Printed per configuration: the first pack's time to the
end of its fit, and the median (min-max) of the later packs'.

    python benchmarks/program_reuse.py [--members 16] [--repeats 4] [--samples 2000]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _packs(members: int, repeats: int, samples: int, cache_dir: str | None) -> list[float]:
    """In this process: seconds from `ModelPack(members)` to the end of a 1-epoch fit."""
    import jax

    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import keras

    from keras_gpushare import ModelPack
    from keras_gpushare._seeds_benchmark.workload import build_mlp, make_data

    x, y = make_data(samples)
    times = []
    for r in range(repeats):
        models = [build_mlp(64, seed=1000 * r + i) for i in range(members)]
        optimizers = [keras.optimizers.Adam(10 ** -(2 + (i + r) % 3)) for i in range(members)]
        start = time.perf_counter()
        pack = ModelPack(models)
        pack.compile(optimizer=optimizers, loss="binary_crossentropy")
        pack.fit(x, y, batch_size=32, epochs=1, verbose=0)
        times.append(time.perf_counter() - start)
    return times


def _fresh(args: argparse.Namespace, cache: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--one",
            folder if cache else "",
            "--members",
            str(args.members),
            "--repeats",
            str(args.repeats),
            "--samples",
            str(args.samples),
        ]
        env = dict(os.environ, KERAS_BACKEND="jax")
        result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(_packs(args.members, args.repeats, args.samples, args.one or None)))
        return 0
    print(
        f"{args.members} seeds' MLPs a pack, {args.repeats} packs a process, 1 epoch of "
        f"{args.samples} samples, Keras on JAX"
    )
    print("| JAX compilation cache | first pack s | later packs s, median (min-max) |")
    print("|---|---:|---:|")
    for cache in (False, True):
        times = _fresh(args, cache)
        later = times[1:]
        print(
            f"| {'on' if cache else 'off'} | {times[0]:.2f} | {statistics.median(later):.2f} "
            f"({min(later):.2f}-{max(later):.2f}) |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
