"""ModelPack against its baselines on the seeds' workload, measured in one run.

Methods: sequential `fit`s (the baseline), the seeds' process pool (2 and N processes),
ModelPack on the graph and fused engines, and a `torch.func` vmap ensemble when PyTorch is
installed. Every measurement runs in a fresh process; every run is repeated (--repeats, in
turn, the order rotated each time). The report gives end-to-end time, the steady aggregate
model-samples/s (median of the epochs after the warm-up, then median and range over the
repeats) and peak RSS, with ratios against sequential fits.

    python benchmarks/pack_vs_baselines.py                       # seeds' model, N=1,4,16
    python benchmarks/pack_vs_baselines.py --architecture mixed  # widths 16/32/48/64
    python benchmarks/pack_vs_baselines.py --architecture varied # and depths, activations
    python benchmarks/pack_vs_baselines.py --suite fused         # N=64 seeds' MLPs, torch peer
    python benchmarks/pack_vs_baselines.py --suite cnn           # small CNN, fused vs graph
    KERAS_BACKEND=jax python benchmarks/pack_vs_baselines.py --members 1,16,64,256 \\
        --methods sequential,pack-fused,torch-vmap --architecture same --sequential-at-most 16
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _cnn import run_cnn_benchmark  # noqa: E402
from _sampled_sequential import sample_sequential  # noqa: E402
from _torch_ensemble import TORCH, torch_runs  # noqa: E402

from keras_gpushare._seeds_benchmark.config import ARCHITECTURES, BenchConfig  # noqa: E402
from keras_gpushare._seeds_benchmark.measure import measure, plan_runs  # noqa: E402
from keras_gpushare._seeds_benchmark.report import format_report  # noqa: E402


def _thread_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected comma-separated thread counts such as 1 or 1,0 "
            "(0: torch's default)."
        )
    return counts


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a positive integer.")
    return int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("pack", "fused", "cnn"), default="pack")
    parser.add_argument("--members", default=None, help="comma-separated member counts")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--methods", default=None, help=f"the bench command's, and {TORCH}")
    parser.add_argument("--architecture", choices=ARCHITECTURES, default=None)
    parser.add_argument(
        "--sequential-at-most",
        type=_positive,
        default=None,
        help="run this many sequential fits and scale the time to all members",
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="TensorFlow threads (0: default)")
    parser.add_argument(
        "--torch-threads",
        type=_thread_counts,
        default=(1,),
        help="torch peer threads, e.g. 1 or 1,0 (0: default)",
    )
    args = parser.parse_args()
    if args.suite == "cnn":
        print(run_cnn_benchmark(members=int(args.members or 16), repeats=args.repeats or 3))
        return 0
    methods, torch = args.methods, args.suite == "fused"
    if methods:  # the bench command's methods, and the torch peer
        chosen = [m.strip() for m in methods.split(",")]
        torch = TORCH in chosen
        methods = ",".join(m for m in chosen if m != TORCH)
    if args.suite == "fused":
        config = BenchConfig(
            members=(1, 16, 64), methods=("sequential", "pack-graph", "pack-fused")
        )
        at_most = args.sequential_at_most or 16
    else:
        config = BenchConfig.full()
        at_most = args.sequential_at_most
    config = config.with_overrides(
        members=args.members,
        samples=args.samples,
        epochs=args.epochs,
        methods=methods or None,
        architecture=args.architecture,
        repeats=args.repeats,
        threads=args.threads,
    )
    runs = [] if methods == "" else plan_runs(config)  # "": only the torch peer
    if at_most:
        runs = sample_sequential(runs, at_most)
    if torch:
        runs += torch_runs(config, args.torch_threads)
    runs.sort(key=lambda run: run[1])  # by member count, methods in order
    print(format_report(config, measure(runs, config.repeats)))
    if torch:
        counts = ", ".join(str(t or "default") for t in args.torch_threads)
        print(f"{TORCH}: torch threads per process: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
