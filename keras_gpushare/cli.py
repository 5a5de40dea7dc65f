"""What the `keras-gpushare` sub-commands run; the parser is `keras_gpushare_cli`.

The parser lives outside the package so that `--help` imports no framework; `main` and
`build_parser` are re-exported here for `python -m keras_gpushare.cli` and for callers of
`keras_gpushare.cli.main([...])`.
"""

from __future__ import annotations

import argparse
import sys

from keras_gpushare_cli import build_parser, main

__all__ = ["build_parser", "main"]


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
    missing: list[str] = []
    needed: dict[str, int] = {}
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


if __name__ == "__main__":
    sys.exit(main())
