"""The `keras-gpushare` command line: its parser, which imports no framework.

`keras-gpushare --help` and every sub-command's `--help` print from this module alone: it
sits outside the `keras_gpushare` package, whose import brings Keras and TensorFlow, JAX or
torch with it. A sub-command imports what it needs when it runs (its `_run_*` function in
`keras_gpushare.cli`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time N small models: sequential fits vs process pool vs ModelPack",
        description=(
            "Runs the seeds' workload (a 10-64-32-1 MLP, batch 32) for N members as "
            "sequential fits, as a process pool (the seeds' method 1) and as a ModelPack, "
            "and prints time, throughput and memory with ratios against sequential."
        ),
    )
    p.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    p.add_argument("--members", default=None, help="comma-separated member counts, e.g. 1,4,16")
    p.add_argument("--samples", type=int, default=None, help="training samples per run")
    p.add_argument("--epochs", type=int, default=None, help="epochs per run")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of: sequential,pool,pack-graph,pack-fused",
    )
    p.add_argument(
        "--architecture",
        choices=("same", "mixed", "varied"),
        default=None,
        help="all the seeds' 64 (same), first widths 16/32/48/64 (mixed), or those widths "
        "with 1-3 hidden layers and relu or tanh (varied)",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="repeat every run this many times, in turn"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="TensorFlow threads per process (0: TensorFlow's default)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="also write throughput vs members, one line per method, as a PNG (needs matplotlib)",
    )
    p.add_argument(
        "--suggest",
        action="store_true",
        help="then suggest a pack size for this machine (find_pack_size on the seeds' MLP)",
    )
    p.set_defaults(func="_run_bench")


def _add_monitor(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "monitor",
        help="live GPU utilization table, one line per device (like nvidia-smi dmon)",
        description=(
            "Samples NVML every --interval seconds and prints one line per GPU: NVML "
            "utilization (share of time a kernel ran), memory-controller utilization, memory "
            "used and free, power, temperature and, on Hopper and newer, SM activity. Honours "
            "CUDA_VISIBLE_DEVICES like UtilizationLogger does."
        ),
    )
    p.add_argument(
        "--interval", type=_positive_float, default=1.0, help="seconds between samples (1)"
    )
    p.add_argument(
        "--count", type=_positive_int, default=None, help="samples to print (until Ctrl-C)"
    )
    p.set_defaults(func="_run_monitor")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="show how a saved model would be split over devices",
        description=(
            "Loads a .keras model, splits it over the given devices with the chosen balance "
            "policy and prints the plan: stages, devices, layers, parameters and estimated "
            "memory per stage. A model saved as a PlacedModel keeps its own placement "
            "unless --devices is given."
        ),
    )
    p.add_argument("model", help="path of a .keras file")
    p.add_argument("--devices", default=None, help="comma-separated devices, e.g. /GPU:0,/GPU:1")
    p.add_argument(
        "--balance",
        default="params",
        help="params, flops, memory, time, or comma-separated stage sizes such as 3,5",
    )
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches per batch")
    p.add_argument("--batch-size", type=int, default=32, help="batch size for the memory estimate")
    p.add_argument(
        "--logical-cpus",
        type=_positive_int,
        default=None,
        metavar="N",
        help="first carve the CPU into N logical CPUs, /CPU:0 .. /CPU:N-1, to plan over",
    )
    p.add_argument(
        "--split-gpu",
        type=_positive_int,
        default=None,
        metavar="K",
        help="first carve each GPU into K logical GPUs, as kg.share_gpu(split=K)",
    )
    p.add_argument(
        "--memory-limit-mb",
        type=_positive_int,
        default=None,
        metavar="M",
        help="memory of each logical GPU made by --split-gpu, in MiB",
    )
    p.set_defaults(func="_run_plan")


def _add_workers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "workers",
        help="run a training script as N local MultiWorkerMirroredStrategy workers",
        description=(
            "Starts COMMAND as N worker processes on this machine, each with its TF_CONFIG "
            "(worker i of a cluster on free loopback ports) and KERAS_GPUSHARE_ATTEMPT. When "
            "a worker fails, all are stopped and, while restarts are left, started again; a "
            "BackupAndRestore callback in the script resumes from its last backup. Exits "
            "with 0 when every worker succeeded, else with the failed worker's status."
        ),
    )
    p.add_argument("-n", "--num-workers", type=int, default=2, help="number of workers")
    p.add_argument(
        "--max-restarts", type=int, default=0, help="restarts of the group after a failure"
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds before all are stopped")
    p.add_argument(
        "--log-dir", default=None, help="write workerI.log files here instead of the terminal"
    )
    p.add_argument(
        "worker_command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND",
        help="the training command, after --, e.g. -- python train.py",
    )
    p.set_defaults(func="_run_workers")


def _add_autopack(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "autopack",
        help="find how many copies of a model to train at once (find_pack_size)",
        description=(
            "Imports BUILD_FN from MODULE (a module name, or a path ending in .py), trains "
            "short ModelPacks of 1, 2, 4, ... of its models on random data of --input-shape, "
            "and prints throughput, memory and GPU utilization per size and the suggested "
            "pack size. Example: keras-gpushare autopack mymodels:build --input-shape 10"
        ),
    )
    p.add_argument("builder", metavar="MODULE:BUILD_FN", help="e.g. mypkg.models:build_model")
    p.add_argument("--input-shape", required=True, help="one sample's shape, e.g. 10 or 28,28,1")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="batch size (32)")
    p.add_argument(
        "--samples", type=_positive_int, default=2048, help="random training rows (2048)"
    )
    p.add_argument(
        "--loss",
        default="mse",
        help="loss; random targets follow it (sparse_categorical_crossentropy: class ids)",
    )
    p.add_argument("--optimizer", default="adam", help="optimizer name (adam)")
    p.add_argument(
        "--max-members", type=_positive_int, default=256, help="largest pack to try (256)"
    )
    p.add_argument(
        "--memory-fraction",
        type=_positive_float,
        default=0.9,
        help="share of the device memory a pack may use (0.9)",
    )
    p.add_argument(
        "--time-budget", type=_positive_float, default=60.0, help="seconds for the search (60)"
    )
    p.set_defaults(func="_run_autopack")


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of the `keras-gpushare` command."""
    parser = argparse.ArgumentParser(
        prog="keras-gpushare",
        description="Make one GPU do the work of many in Keras 3.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_bench(subparsers)
    _add_monitor(subparsers)
    _add_plan(subparsers)
    _add_autopack(subparsers)
    _add_workers(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line and returns its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    try:
        run = getattr(importlib.import_module("keras_gpushare.cli"), args.func)
        return int(run(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"keras-gpushare {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
