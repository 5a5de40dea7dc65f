"""What a fused pack's compiled training step holds, counted: XLA fusions and TF graph ops.

On a GPU a small model's step costs its kernel launches, so a step whose count grows with
the member count is slow at any N. `step_counts(config, n)` builds a pack of `n` members of
one of `CONFIGS` (the common compile settings), trains it one batch and counts:

- `fusions`: the XLA fusions of the optimized step (JAX; TensorFlow with `jit_compile=True`);
- `graph_ops`: the operations of the traced TensorFlow step, function library included.

Run as a script to print the table: `python tests/pack/step_counts.py 1 16 256`.
"""

from __future__ import annotations

import re
import sys

import keras
import numpy as np

import keras_gpushare as kg

BATCH = 16


def _dense(widths, outputs, activation):
    def build(i):
        inputs = keras.Input((6,))
        h = keras.layers.Dense(widths[i % len(widths)], activation="relu")(inputs)
        if outputs == 1:
            return keras.Model(inputs, keras.layers.Dense(*activation)(h))
        a = keras.layers.Dense(*activation, name="a")(h)
        b = keras.layers.Dense(2, name="b")(h)
        return keras.Model(inputs, [a, b])

    return build


def _regularized(i):
    """Widths 8 and 12, each member its own L2 strength and an L1L2 on its head's bias."""
    inputs = keras.Input((6,))
    h = keras.layers.Dense(
        (8, 12)[i % 2],
        activation="relu",
        kernel_regularizer=keras.regularizers.L2(0.01 * (1 + i % 3)),
    )(inputs)
    head = keras.layers.Dense(1, bias_regularizer=keras.regularizers.L1L2(0.001, 0.002))
    return keras.Model(inputs, head(h))


def smooth_error(y_true, y_pred):
    """A user's loss function: one value per sample, as Keras's own give."""
    return keras.ops.mean(keras.ops.log(keras.ops.cosh(y_pred - y_true)), axis=-1)


def batch_error(y_true, y_pred):
    """A user's loss function that reduces over the batch itself: one value per batch."""
    return keras.ops.mean(keras.ops.abs(y_pred - y_true))


class HitRate(keras.metrics.Metric):
    """A user's metric with its own configuration (`get_config`) and a state that does not
    start at zero (one pseudo-hit in one pseudo-sample), weighted by sample weights."""

    def __init__(self, threshold=0.5, name="hit_rate", **kwargs):
        super().__init__(name=name, **kwargs)
        self.threshold = threshold
        self.hits = self.add_variable((), initializer="ones", name="hits")
        self.seen = self.add_variable((), initializer="ones", name="seen")

    def update_state(self, y_true, y_pred, sample_weight=None):
        predicted = keras.ops.cast(keras.ops.greater(y_pred, self.threshold), "float32")
        hit = keras.ops.cast(
            keras.ops.equal(predicted, keras.ops.cast(y_true, "float32")), "float32"
        )
        weight = keras.ops.ones_like(hit)
        if sample_weight is not None:
            weight = weight * keras.ops.reshape(keras.ops.cast(sample_weight, "float32"), (-1, 1))
        self.hits.assign_add(keras.ops.sum(hit * weight))
        self.seen.assign_add(keras.ops.sum(weight))

    def result(self):
        return self.hits / self.seen

    def reset_state(self):
        self.hits.assign(1.0)
        self.seen.assign(1.0)

    def get_config(self):
        return {**super().get_config(), "threshold": self.threshold}


def _data(config, rng):
    x = rng.normal(size=(BATCH * 2, 6)).astype("float32")
    kind = config["labels"]
    if kind == "binary":
        y = (rng.random((len(x), 1)) > 0.5).astype("float32")
    elif kind == "sparse":
        y = rng.integers(0, 10, size=(len(x),)).astype("int32")
    elif kind == "onehot":
        y = np.eye(10, dtype="float32")[rng.integers(0, 10, size=len(x))]
    else:
        y = rng.normal(size=(len(x), 1)).astype("float32")
    if config.get("two_outputs"):
        y = (y, rng.normal(size=(len(x), 2)).astype("float32"))
    return x, y


# The common compile settings the issue names: losses, metrics, weights, two outputs.
CONFIGS = {
    # The seeds' MLP: 10-64-32-1, Adam, binary cross-entropy, accuracy.
    "seeds": {
        "build": lambda i: keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        ),
        "labels": "binary",
        "compile": lambda: {
            "optimizer": "adam",
            "loss": "binary_crossentropy",
            "metrics": ["accuracy"],
        },
    },
    # Confusion-matrix metrics beside the metrics that make or shape their state on their
    # first update (F1, R2), RMSE and IoU.
    "binary": {
        "build": _dense([8, 12], 1, (1, "sigmoid")),
        "labels": "binary",
        "compile": lambda: {
            "optimizer": "adam",
            "loss": "binary_crossentropy",
            "metrics": [
                "accuracy",
                # Few thresholds: the count is the same, the XLA compile at N=256 shorter.
                keras.metrics.AUC(num_thresholds=10),
                keras.metrics.Precision(),
                keras.metrics.F1Score(average="micro", threshold=0.5),
                keras.metrics.BinaryIoU(),
                keras.metrics.R2Score(),
                keras.metrics.RootMeanSquaredError(),
            ],
        },
        "sample_weight": True,
    },
    "sparse": {
        "build": _dense([8, 12, 16, 20], 1, (10, "softmax")),
        "labels": "sparse",
        "compile": lambda: {
            "optimizer": "adam",
            "loss": "sparse_categorical_crossentropy",
            "metrics": ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3)],
        },
        "class_weight": True,
    },
    "categorical": {
        "build": _dense([8, 12], 1, (10, "softmax")),
        "labels": "onehot",
        "compile": lambda: {
            "optimizer": "sgd",
            "loss": "categorical_crossentropy",
            "metrics": ["accuracy"],
        },
    },
    # Members of different losses (`loss_cycle`, member i the i-th modulo), Keras's own
    # and a user's, of the default reduction and others, one value per sample or per batch.
    "regression": {
        "build": _dense([8, 12], 1, (1,)),
        "labels": "real",
        "compile": lambda: {"optimizer": "adam", "metrics": ["mae"]},
        "loss_cycle": [
            "mse",
            "mae",
            smooth_error,
            "huber",
            keras.losses.MeanSquaredError(reduction="sum"),
            batch_error,
        ],
        "sample_weight": True,
    },
    "two_outputs": {
        "build": _dense([8, 12], 2, (1,)),
        "labels": "real",
        "two_outputs": True,
        "compile": lambda: {
            "optimizer": "adam",
            "loss": {"a": "mse", "b": "mae"},
            "metrics": {"a": ["mae"]},
        },
    },
    # Weighted metrics beside unweighted ones of the same names (Keras logs
    # `weighted_accuracy`), with class weights.
    "weighted": {
        "build": _dense([8, 12], 1, (1, "sigmoid")),
        "labels": "binary",
        "compile": lambda: {
            "optimizer": "adam",
            "loss": "binary_crossentropy",
            "metrics": ["accuracy"],
            # Few thresholds: the count is the same, TensorFlow's XLA compile at N=256 shorter.
            "weighted_metrics": ["accuracy", keras.metrics.AUC(num_thresholds=10), "mse"],
        },
        "sample_weight": True,
    },
    # Labels one per member (`y=[y0, y1, ...]`), stacked; from N=2.
    "labels_per_member": {
        "build": _dense([8, 12], 1, (1, "sigmoid")),
        "labels": "binary",
        "labels_per_member": True,
        "compile": lambda: {
            "optimizer": "adam",
            "loss": "binary_crossentropy",
            "metrics": ["accuracy", keras.metrics.AUC(num_thresholds=10)],
        },
        "sample_weight": True,
    },
    # A user's metric class, alike for every member.
    "user_metric": {
        "build": _dense([8, 12], 1, (1, "sigmoid")),
        "labels": "binary",
        "compile": lambda: {
            "optimizer": "adam",
            "loss": "binary_crossentropy",
            "metrics": ["accuracy", HitRate()],
        },
    },
    # A user's loss function and members' own regularizers, padded.
    "user_loss": {
        "build": _regularized,
        "labels": "real",
        "compile": lambda: {"optimizer": "adam", "loss": smooth_error, "metrics": ["mae"]},
        "sample_weight": True,
    },
}


def fit_one_batch(config: dict, n: int, jit_compile: bool):
    """A pack of `n` members of `config`, compiled and trained on one batch."""
    rng = np.random.default_rng(0)
    x, y = _data(config, rng)
    keras.utils.set_random_seed(0)
    pack = kg.ModelPack.from_builder(config["build"], n=n, fuse=True)
    compile_args = config["compile"]()
    if "loss_cycle" in config:
        cycle = config["loss_cycle"]
        compile_args["loss"] = [cycle[i % len(cycle)] for i in range(n)]
    pack.compile(**compile_args, jit_compile=jit_compile)
    if config.get("labels_per_member"):
        y = [y if i % 2 == 0 else 1.0 - y for i in range(n)]
    kwargs = {}
    sample_weight = None
    if config.get("sample_weight"):
        sample_weight = rng.random(len(x)).astype("float32")
        kwargs["sample_weight"] = sample_weight
    if config.get("class_weight"):
        kwargs["class_weight"] = {c: 1.0 + 0.1 * c for c in range(10)}
    pack.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=1, verbose=0, **kwargs)
    assert pack.engine == "fused", pack.fusion_report
    return pack, x, y, sample_weight


def _batch(x, y, sample_weight):
    return (x[:BATCH], keras.tree.map_structure(lambda a: a[:BATCH], y)) + (
        () if sample_weight is None else (sample_weight[:BATCH],)
    )


def fusions(hlo_text: str) -> int:
    """The fusions of an optimized HLO module's text."""
    return len(re.findall(r"\sfusion\(", hlo_text))


def step_counts(name: str, n: int) -> dict:
    """The counts of one pack's training step (see the module docstring)."""
    config = CONFIGS[name]
    backend = keras.backend.backend()
    result = {}
    if backend == "jax":
        import jax

        pack, x, y, sample_weight = fit_one_batch(config, n, jit_compile=True)
        state = (
            [v.value for v in pack.trainable_variables],
            [v.value for v in pack.non_trainable_variables],
            [v.value for v in pack.optimizer.variables],
            [v.value for v in pack.metrics_variables],
        )
        data = _batch(x, y, sample_weight)
        text = jax.jit(pack.train_step).lower(state, data).compile().as_text()
        result["fusions"] = fusions(text)
    elif backend == "tensorflow":
        import tensorflow as tf

        pack, x, y, sample_weight = fit_one_batch(config, n, jit_compile=False)
        data = tf.nest.map_structure(tf.constant, _batch(x, y, sample_weight))
        graph = tf.function(pack.train_step).get_concrete_function(data).graph.as_graph_def()
        result["graph_ops"] = len(graph.node) + sum(len(f.node_def) for f in graph.library.function)
        xla = tf.function(pack.train_step, jit_compile=True)
        result["fusions"] = fusions(xla.experimental_get_compiler_ir(data)(stage="optimized_hlo"))
    return result


if __name__ == "__main__":
    names = [a for a in sys.argv[1:] if a in CONFIGS] or list(CONFIGS)
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 16, 256]
    for config_name in names:
        counts = {n: step_counts(config_name, n) for n in sizes}
        print(config_name, counts, flush=True)  # noqa: T201
