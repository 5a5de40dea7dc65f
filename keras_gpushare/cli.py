"""The `keras-gpushare` command line: one sub-command per part of the plugin."""

from __future__ import annotations

import argparse
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
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from keras_gpushare._seeds_benchmark.config import BenchConfig
    from keras_gpushare._seeds_benchmark.measure import measure, plan_runs
    from keras_gpushare._seeds_benchmark.report import format_report

    config = BenchConfig.quick() if args.quick else BenchConfig.full()
    config = config.with_overrides(
        members=args.members,
        samples=args.samples,
        epochs=args.epochs,
        methods=args.methods,
        architecture=args.architecture,
        repeats=args.repeats,
        threads=args.threads,
    )
    if args.plot:
        from keras_gpushare._seeds_benchmark import plot

        plot.check_plot_path(args.plot)
    results = measure(plan_runs(config), config.repeats)
    if args.plot:
        plot.plot_throughput(results, args.plot)
    print(format_report(config, results))
    if args.plot:
        print(f"plot: {args.plot}")
    if args.suggest:
        _suggest_pack_size()
    return 0


def _suggest_pack_size() -> None:
    import keras_gpushare as kg
    from keras_gpushare._seeds_benchmark import workload

    print("\nSuggested pack size for this machine (find_pack_size, seeds' MLP, batch 32):")
    x, y = workload.make_data(2048)
    result = kg.find_pack_size(
        lambda i: workload.build_mlp(64, seed=i),
        x,
        y,
        batch_size=32,
        max_members=64,
        time_budget_s=30,
        compile_kwargs={"optimizer": "adam", "loss": "binary_crossentropy"},
        progress=_print_measurement,
    )
    print()
    print(result)


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
    p.set_defaults(func=_run_monitor)


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


def _run_monitor(args: argparse.Namespace) -> int:
    from keras_gpushare.monitor._table import LiveTable

    table = LiveTable(interval=args.interval)
    problem = table.open()
    try:
        if problem is not None:
            print(f"keras-gpushare monitor: no GPU to monitor: {problem}.", file=sys.stderr)
            return 1
        for line in table.lines(count=args.count):
            print(line, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        table.close()
    return 0


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
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    _make_logical_devices(args)
    import keras

    import keras_gpushare as kg

    if args.devices is not None:
        _check_plan_devices(args.devices.split(","))
    model = keras.models.load_model(args.model, compile=False)
    if args.devices is None and not isinstance(model, kg.PlacedModel):
        raise ValueError(
            f"{args.model} holds a model that is not placed; pass --devices, e.g. "
            "--devices /GPU:0,/GPU:1"
        )
    if args.devices is not None:
        balance = args.balance
        if balance.replace(",", "").isdigit():
            balance = [int(s) for s in balance.split(",")]
        model = kg.split_model(
            model,
            devices=args.devices.split(","),
            balance=balance,
            microbatches=args.microbatches,
            batch_size=args.batch_size,
        )
    print(model.get_plan(batch_size=args.batch_size))
    return 0


def _make_logical_devices(args: argparse.Namespace) -> None:
    """Carves the logical devices `plan` was asked for, before TensorFlow initializes."""
    import tensorflow as tf

    from keras_gpushare.devices import share_gpu, split_cpu

    if args.memory_limit_mb is not None and args.split_gpu is None:
        raise ValueError(
            "Invalid option --memory-limit-mb without --split-gpu: it is the memory of each "
            "logical GPU that --split-gpu makes. Add --split-gpu K, or drop it."
        )
    if args.split_gpu is not None:
        if not tf.config.list_physical_devices("GPU"):
            raise ValueError(
                f"Invalid option --split-gpu {args.split_gpu}: this machine has no GPU to "
                f"split. Plan over logical CPUs instead: --logical-cpus {args.split_gpu} "
                "with --devices /CPU:0,/CPU:1,... (the stages are the same)."
            )
        if args.memory_limit_mb is None:
            raise ValueError(
                f"Invalid option --split-gpu {args.split_gpu} without --memory-limit-mb: "
                "logical GPUs need a memory limit each. Add e.g. --memory-limit-mb 4096 "
                "(the logical GPUs of one GPU must fit in its memory together)."
            )
        share_gpu(split=args.split_gpu, memory_limit_mb=args.memory_limit_mb)
    if args.logical_cpus is not None:
        split_cpu(args.logical_cpus)


def _check_plan_devices(devices: list[str]) -> None:
    """Says which `plan` option makes the devices TensorFlow lacks, before loading."""
    import tensorflow as tf

    from keras_gpushare.placement._graph import available_devices

    known = available_devices()
    missing, needed = [], {}
    for device in devices:
        try:
            spec = tf.DeviceSpec.from_string(device)
        except (ValueError, TypeError):
            continue  # not a device name: split_model says so
        kind, index = (spec.device_type or "").upper(), spec.device_index or 0
        if kind and f"/{kind}:{index}" not in known:
            missing.append(device)
            needed[kind] = max(needed.get(kind, 0), index + 1)
    if not missing:
        return
    gpus = len(tf.config.list_physical_devices("GPU"))
    if "GPU" in needed and not gpus:
        cpus = ",".join(f"/CPU:{i}" for i in range(len(devices)))
        fix = (
            f"--devices {cpus} --logical-cpus {len(devices)} (this machine has no GPU; the "
            "stages are the same)"
        )
    else:
        fixes = [f"--logical-cpus {needed['CPU']}"] if "CPU" in needed else []
        if "GPU" in needed:
            fixes.append(f"--split-gpu {-(-needed['GPU'] // gpus)} --memory-limit-mb M")
        fix = " and ".join(fixes)
    raise ValueError(
        f"Invalid value for --devices: TensorFlow has no device {', '.join(missing)}; it "
        f"sees {known}. Make the logical devices to plan over with {fix}."
    )


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
    p.set_defaults(func=_run_workers)


def _run_workers(args: argparse.Namespace) -> int:
    from keras_gpushare.workers import run_local_workers

    command = args.worker_command
    if command[:1] == ["--"]:
        command = command[1:]
    return run_local_workers(
        command,
        num_workers=args.num_workers,
        max_restarts=args.max_restarts,
        timeout=args.timeout,
        log_dir=args.log_dir,
    )


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
    p.set_defaults(func=_run_autopack)


def _run_autopack(args: argparse.Namespace) -> int:
    from keras_gpushare.autopack import cli as _autopack_cli

    build_fn = _autopack_cli.load_builder(args.builder)
    shape = _autopack_cli.parse_shape(args.input_shape)
    if args.batch_size > args.samples:
        raise ValueError(
            f"Invalid value for --batch-size: got {args.batch_size} for --samples "
            f"{args.samples}. Pass a batch size of at most the number of samples."
        )
    import keras_gpushare as kg

    x, y = _autopack_cli.random_data(build_fn, shape, args.samples, args.loss)
    print(f"keras-gpushare autopack: {args.builder}, input {shape}, batch {args.batch_size}")
    result = kg.find_pack_size(
        build_fn,
        x,
        y,
        batch_size=args.batch_size,
        max_members=args.max_members,
        memory_fraction=args.memory_fraction,
        time_budget_s=args.time_budget,
        compile_kwargs={"optimizer": args.optimizer, "loss": args.loss},
        progress=_print_measurement,
    )
    print()
    print(result)
    return 0


def _print_measurement(row) -> None:
    if row.status == "ok":
        text = f"{row.samples_per_s:,.0f} model-samples/s on the {row.engine} engine"
    else:
        text = row.status.replace("_", " ") + (f" ({row.error})" if row.error else "")
    print(f"  {row.members:>4} members: {text}, {row.seconds:.1f} s", flush=True)


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
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"keras-gpushare {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
