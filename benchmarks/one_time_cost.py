"""What a pack pays once (building, fusing, tracing, compiling) as its member count grows.

For each member count N, in a fresh process: N of the seeds' MLPs (10-64-32-1, Adam, batch
32) are built, then trained as one fused `ModelPack` for a few short epochs; one plain model
is trained the same way as the reference. Reported per N:

- `build s`: building the N Keras member models (before `ModelPack(members)`);
- `one-time s`: from `ModelPack(members)` (plain model: from `compile`) to the end of the
  fit, less epochs x the median steady epoch: what the user waits for beyond training;
- `vs plain`: that one-time cost over one plain model's, measured in the same run;
- `step ops`: operations in the traced training step (TensorFlow: the nodes of one traced
  `train_step`, its function library included), which a compile-once design keeps flat in N;
- `programs` (JAX): XLA programs compiled from `ModelPack(members)` (plain model: from
  `compile`) to the end of the fit, the training step and every eager operation included.

`--architecture mixed` gives the members first widths 16, 32, 48 and 64 in turn (a padded
fused group) instead of the seeds' 64 for all. `--metrics confusion` compiles them with
`["accuracy", AUC, Precision, F1Score]` (F1 makes its state from the first batch it sees)
instead of no metrics.

    python benchmarks/one_time_cost.py                      # N = 1, 16, 64, 256
    python benchmarks/one_time_cost.py --members 1,16 --epochs 3 --jit-compile false
    KERAS_BACKEND=jax python benchmarks/one_time_cost.py --members 1,8,64 --architecture mixed
    python benchmarks/one_time_cost.py --members 64,256 --metrics confusion
"""

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _step_ops(model, x, y):
    """Operations of one traced `train_step` (TensorFlow), function library included."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    spec = (
        tf.TensorSpec((32,) + x.shape[1:], x.dtype),
        tf.TensorSpec((32,) + y.shape[1:], y.dtype),
    )
    graph = tf.function(model.train_step).get_concrete_function(spec).graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


class _XlaPrograms:
    """Counts the programs JAX compiles (its `jax_log_compiles` messages) while active."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self):
        import keras

        if keras.backend.backend() != "jax":
            self.count = None
            return self
        import jax

        handler = logging.Handler()
        handler.emit = self._emit
        self._handler, self._logger = handler, logging.getLogger("jax")
        self._logger.addHandler(handler)
        self._logs = jax.log_compiles(True)
        self._logs.__enter__()
        return self

    def _emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Compiling ")

    def __exit__(self, *exc) -> None:
        if self.count is not None:
            self._logs.__exit__(*exc)
            self._logger.removeHandler(self._handler)


def _metrics(name: str) -> list:
    import keras

    if name == "none":
        return []
    return [
        "accuracy",
        keras.metrics.AUC(),
        keras.metrics.Precision(),
        keras.metrics.F1Score(average="micro", threshold=0.5),
    ]


def _measure(
    members: int, samples: int, epochs: int, jit_compile, mixed: bool, metrics: str
) -> dict:
    """One run in this process: the pack of `members` MLPs, or one plain model for 0."""
    from keras_gpushare import ModelPack
    from keras_gpushare._seeds_benchmark.workload import build_mlp, epoch_timer, make_data

    x, y = make_data(samples)
    timer = epoch_timer()
    start = time.perf_counter()
    widths = (16, 32, 48, 64) if mixed else (64,)
    models = [build_mlp(widths[i % len(widths)], seed=i) for i in range(max(members, 1))]
    built = time.perf_counter()
    with _XlaPrograms() as programs:
        model = ModelPack(models) if members else models[0]
        model.compile(
            optimizer="adam",
            loss="binary_crossentropy",
            metrics=_metrics(metrics),
            jit_compile=jit_compile,
        )
        model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[timer])
    total = time.perf_counter() - built
    steady = statistics.median(timer.times[1:])
    return {
        "build_s": built - start,
        "one_time_s": total - epochs * steady,
        "steady_epoch_s": steady,
        "step_ops": _step_ops(model, x, y),
        "programs": programs.count,
    }


def _fresh(members: int, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        str(members),
        "--samples",
        str(args.samples),
        "--epochs",
        str(args.epochs),
        "--jit-compile",
        args.jit_compile,
        "--architecture",
        args.architecture,
        "--metrics",
        args.metrics,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _jit(text: str):
    return {"auto": "auto", "true": True, "false": False}[text.lower()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="1,16,64,256")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--jit-compile", default="auto", choices=("auto", "true", "false"))
    parser.add_argument("--architecture", default="same", choices=("same", "mixed"))
    parser.add_argument("--metrics", default="none", choices=("none", "confusion"))
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        mixed = args.architecture == "mixed"
        jit = _jit(args.jit_compile)
        result = _measure(args.one, args.samples, args.epochs, jit, mixed, args.metrics)
        print(json.dumps(result))
        return 0
    counts = [int(n) for n in args.members.split(",")]
    runs = {n: [] for n in [0] + counts}
    for _ in range(args.repeats):
        for n in runs:
            runs[n].append(_fresh(n, args))
    plain = statistics.median(r["one_time_s"] for r in runs[0])
    print(
        f"backend {os.environ.get('KERAS_BACKEND', 'tensorflow')}, jit_compile="
        f"{args.jit_compile}, {args.architecture} widths, metrics {args.metrics}, "
        f"{args.samples} samples x "
        f"{args.epochs} epochs, "
        f"{args.repeats} repeats (median, min-max)"
    )
    print("| members | build s | one-time s | vs plain | steady epoch s | step ops | programs |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, results in runs.items():

        def cell(key, results=results):
            values = [r[key] for r in results]
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

        ratio = statistics.median(r["one_time_s"] for r in results) / plain
        label = "plain model" if n == 0 else str(n)
        print(
            f"| {label} | {cell('build_s')} | {cell('one_time_s')} | {ratio:.1f}x | "
            f"{cell('steady_epoch_s')} | {results[0]['step_ops']} | {results[0]['programs']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
