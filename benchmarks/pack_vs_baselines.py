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

from keras_gpushare._bench.pack import (  # noqa: E402
    ARCHITECTURES,
    BenchConfig,
    format_report,
    run_pack_benchmark,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("pack", "fused", "cnn"), default="pack")
    parser.add_argument("--members", default=None, help="comma-separated member counts")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--methods", default=None)
    parser.add_argument("--architecture", choices=ARCHITECTURES, default=None)
    parser.add_argument("--sequential-at-most", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="TensorFlow threads (0: default)")
    parser.add_argument(
        "--torch-threads", default=None, help="torch peer threads, e.g. 1 or 1,0 (0: default)"
    )
    args = parser.parse_args()
    if args.suite == "cnn":
        print(run_cnn_benchmark(members=int(args.members or 16), repeats=args.repeats or 3))
        return 0
    if args.suite == "fused":
        config = BenchConfig(
            members=(1, 16, 64),
            methods=("sequential", "pack-graph", "pack-fused", "torch-vmap"),
            sequential_at_most=16,
        )
    else:
        config = BenchConfig.full()
    config = config.with_overrides(
        members=args.members,
        samples=args.samples,
        epochs=args.epochs,
        methods=args.methods,
        architecture=args.architecture,
        sequential_at_most=args.sequential_at_most,
        repeats=args.repeats,
        threads=args.threads,
        torch_threads=args.torch_threads,
    )
    print(format_report(config, run_pack_benchmark(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
