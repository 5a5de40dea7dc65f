"""The cases of the conformance matrix: one Keras feature each, and what fails today.

Every case builds N members from seeds (different initial weights), gives them different
optimizer hyperparameters where the feature allows, and trains the twins with exactly the
arguments the pack gets. `KNOWN_FAILURES` marks the (case, engine, aspect, backend) cells
that differ today as strict xfails: each names the issue-12 item (or "conformance: ...")
and turns red once fixed, so the marker can go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import keras
import numpy as np
from conformance_harness import BACKEND, Case, Who, files_in

import keras_gpushare as kg

ROWS = 96
VALIDATION = 32
FEATURES = 5
CLASSES = 3


@functools.cache
def _arrays() -> dict:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS + VALIDATION, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, 1)).astype("float32")
    binary = (x[:, :2].sum(axis=1, keepdims=True) > 0).astype("float32")
    regression = (x @ w + 0.3).astype("float32")
    classes = np.argmax(x[:, :CLASSES], axis=1).astype("int32")
    split = {}
    for name, value in {
        "x": x,
        "y": binary,
        "y_reg": regression,
        "y_cls": classes,
        "sample_weight": np.linspace(0.2, 2.0, len(x)).astype("float32"),
    }.items():
        split[name] = value[:ROWS]
        split[f"{name}_val"] = value[ROWS:]
    return split


def arrays() -> dict:
    return dict(_arrays())


def mlp(i: int, width: int, outputs: int = 1, activation: str | None = "sigmoid") -> keras.Model:
    keras.utils.set_random_seed(100 + i)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(outputs, activation=activation),
        ],
        name=f"mlp{i}",
    )


def plain_fit(epochs: int = 2, batch_size: int = 16, validation: bool = True, **extra):
    """`fit(data, who)` for the binary task: the same arguments for twins and pack."""

    def fit(data: dict, who: Who) -> dict:
        kwargs = {
            "x": data["x"],
            "y": data["y"],
            "batch_size": batch_size,
            "epochs": epochs,
            "shuffle": False,
            "verbose": 0,
        }
        if validation:
            kwargs["validation_data"] = (data["x_val"], data["y_val"])
        kwargs.update(extra)
        return kwargs

    return fit


def validation_arrays(data: dict) -> tuple:
    return data["x_val"], data["y_val"]


def _case(name: str, **kwargs) -> Case:
    kwargs.setdefault("build", mlp)
    kwargs.setdefault("data", arrays)
    kwargs.setdefault("fit", plain_fit())
    kwargs.setdefault("evaluate", validation_arrays)
    return Case(name, **kwargs)


# Plain fit features ------------------------------------------------------------------------


def _sample_weight_fit(data: dict, who: Who) -> dict:
    return {
        **plain_fit()(data, who),
        "sample_weight": data["sample_weight"],
        "validation_data": (data["x_val"], data["y_val"], data["sample_weight_val"]),
    }


def _weighted_compile(i: int) -> dict:
    return {
        "optimizer": keras.optimizers.SGD((0.1, 0.05)[i], momentum=(0.0, 0.9)[i]),
        "loss": "binary_crossentropy",
        "metrics": ["accuracy"],
        "weighted_metrics": ["binary_crossentropy"],
    }


def _tf_data_fit(data: dict, who: Who) -> dict:
    import tensorflow as tf

    train = tf.data.Dataset.from_tensor_slices((data["x"], data["y"])).batch(16)
    val = tf.data.Dataset.from_tensor_slices((data["x_val"], data["y_val"])).batch(16)
    return {"x": train, "validation_data": val, "epochs": 2, "shuffle": False, "verbose": 0}


def _regression_compile(i: int) -> dict:
    # With these rates member 0 overshoots and stops early at epoch 4; member 1 trains on.
    return {
        "optimizer": keras.optimizers.RMSprop((0.1, 0.003)[i]),
        "loss": "mse",
        "metrics": ["mae"],
    }


def _regression_fit(data: dict, who: Who) -> dict:
    return {
        "x": data["x"],
        "y": data["y_reg"],
        "batch_size": 16,
        "epochs": 2,
        "shuffle": False,
        "verbose": 0,
        "validation_data": (data["x_val"], data["y_reg_val"]),
    }


def _regression_eval(data: dict) -> tuple:
    return data["x_val"], data["y_reg_val"]


def _early_stopping_callbacks(who: Who, folder) -> list:
    # min_delta=10 never counts as an improvement after the first epoch: fit stops after
    # epoch 2 whatever the figures, for each twin and for the pack (judged on member 1).
    return [
        keras.callbacks.EarlyStopping(
            monitor=who.key("val_loss", member=1),
            patience=0,
            min_delta=10.0,
            restore_best_weights=True,
        )
    ]


def _schedule_compile(i: int) -> dict:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.03, 3, (0.5, 0.8)[i])
    return {
        "optimizer": keras.optimizers.Adam(schedule),
        "loss": "binary_crossentropy",
        "metrics": ["accuracy"],
    }


def _sgd_regression_compile(i: int) -> dict:
    # SGD: a float16 rounding difference moves the weights by as much; Adam would scale
    # a near-zero gradient's noise up to a full step. No accuracy: one flipped sample
    # changes it by 1/32.
    return {"optimizer": keras.optimizers.SGD((0.01, 0.005)[i]), "loss": "mse", "metrics": ["mae"]}


def _same_rate_compile(i: int) -> dict:
    # LR callbacks set one rate for the model: members share it and differ in beta_1.
    return {
        "optimizer": keras.optimizers.Adam(0.02, beta_1=(0.9, 0.8)[i]),
        "loss": "binary_crossentropy",
        "metrics": ["accuracy"],
    }


def _lr_scheduler_callbacks(who: Who, folder) -> list:
    return [keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.25 if epoch else lr)]


def _reduce_lr_callbacks(who: Who, folder) -> list:
    # min_delta=10: no epoch after the first improves, so the rate drops every epoch.
    return [
        keras.callbacks.ReduceLROnPlateau(
            monitor=who.key("val_loss"), factor=0.2, patience=0, min_delta=10.0
        )
    ]


def _fit_twice_save_load(model, who, callbacks, folder, data):
    """Fit, fit again (optimizer state carries on), save, load, fit the loaded model."""
    fit = plain_fit(epochs=1)(data, who)
    histories = [model.fit(**fit, callbacks=callbacks).history]
    histories.append(model.fit(**fit, callbacks=callbacks).history)
    path = folder / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    histories.append(loaded.fit(**fit, callbacks=callbacks).history)
    return loaded, {k: sum((h[k] for h in histories), []) for k in histories[0]}


class _Interrupted(Exception):
    """What `_Interrupt` raises."""


class _Interrupt(keras.callbacks.Callback):
    """Raises at the start of epoch `at` (0-based), as a crash or a kill would."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise _Interrupted(f"interrupted at the start of epoch {epoch + 1}")


def _backup_and_restore(model, who, callbacks, folder, data):
    fit = plain_fit(epochs=3)(data, who)
    backup = folder / "backup"
    try:
        model.fit(**fit, callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt(2)])
    except _Interrupted:
        pass
    else:
        raise AssertionError("the interruption did not happen")
    (folder / "backup_files.txt").write_text("\n".join(files_in(backup)))
    history = model.fit(
        **fit, callbacks=[*callbacks, keras.callbacks.BackupAndRestore(backup)]
    ).history
    return model, history


def _file_callbacks(who: Who, folder) -> list:
    return [
        keras.callbacks.CSVLogger(str(folder / "log.csv")),
        keras.callbacks.TensorBoard(log_dir=str(folder / "tb"), write_graph=False),
        keras.callbacks.ModelCheckpoint(str(folder / "ckpt" / "e{epoch:02d}.keras")),
    ]


def _logits_compile(i: int) -> dict:
    return {
        "optimizer": keras.optimizers.Adam((0.01, 0.02)[i]),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": [keras.metrics.SparseCategoricalAccuracy()],
    }


def _classes_fit(data: dict, who: Who) -> dict:
    return {
        "x": data["x"],
        "y": data["y_cls"],
        "batch_size": 16,
        "epochs": 2,
        "shuffle": False,
        "verbose": 0,
        "validation_data": (data["x_val"], data["y_cls_val"]),
    }


def _classes_eval(data: dict) -> tuple:
    return data["x_val"], data["y_cls_val"]


def _linear_mlp(i: int, width: int) -> keras.Model:
    return mlp(i, width, activation=None)


def _logits_mlp(i: int, width: int) -> keras.Model:
    return mlp(i, width, outputs=CLASSES, activation=None)


@keras.saving.register_keras_serializable(package="conformance")
class Subclassed(keras.Model):
    """A subclassed member: no graph to fuse, so it trains on the graph engine."""

    def __init__(self, width: int = 6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.width = width
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.out = keras.layers.Dense(1, activation="sigmoid")

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self) -> dict:
        return {**super().get_config(), "width": self.width}


def _subclassed(i: int, width: int) -> keras.Model:
    keras.utils.set_random_seed(100 + i)
    model = Subclassed(width)
    model(np.zeros((1, FEATURES), "float32"))
    return model


def _two_inputs(i: int, width: int) -> keras.Model:
    keras.utils.set_random_seed(100 + i)
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(width, activation="relu")(a), b])
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(1, activation="sigmoid")(h))


def _split_inputs(x):
    return {"a": x[:, :3], "b": x[:, 3:]}


def _two_inputs_fit(data: dict, who: Who) -> dict:
    return {
        **plain_fit()(data, who),
        "x": _split_inputs(data["x"]),
        "validation_data": (_split_inputs(data["x_val"]), data["y_val"]),
    }


def _two_inputs_eval(data: dict) -> tuple:
    return _split_inputs(data["x_val"]), data["y_val"]


def _shard_fit(data: dict, who: Who) -> dict:
    # The pack's batch of 32 rows gives member i rows i, i+2, ...: 16 rows, the rows of
    # x[i::2] in order (96 rows divide into whole batches), the seeds' `x[i::n]`.
    if who.is_pack:
        return plain_fit(batch_size=32)(data, who)
    i, n = who.index, who.n
    fit = plain_fit(batch_size=16)(data, who)
    return {**fit, "x": data["x"][i::n], "y": data["y"][i::n]}


# Multi-output members (item 2) -----------------------------------------------------------


def _two_outputs(i: int, width: int, as_dict: bool = False) -> keras.Model:
    keras.utils.set_random_seed(100 + i)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(width, activation="relu")(inputs)
    price = keras.layers.Dense(1, name="price")(h)
    category = keras.layers.Dense(CLASSES, activation="softmax", name="category")(h)
    outputs = {"price": price, "category": category} if as_dict else [price, category]
    return keras.Model(inputs, outputs, name=f"two_outputs{i}")


def _two_dict_outputs(i: int, width: int) -> keras.Model:
    return _two_outputs(i, width, as_dict=True)


def _list_outputs_compile(i: int) -> dict:
    return {
        "optimizer": keras.optimizers.Adam((0.01, 0.02)[i]),
        "loss": ["mse", "sparse_categorical_crossentropy"],
        "metrics": ["mae", "accuracy"],
    }


def _dict_outputs_compile(i: int) -> dict:
    return {
        "optimizer": keras.optimizers.Adam((0.01, 0.02)[i]),
        "loss": {"price": "mse", "category": "sparse_categorical_crossentropy"},
        "metrics": {"price": ["mae"], "category": ["accuracy"]},
    }


def _labels(data: dict, form: str, suffix: str = "", n: int = 2):
    price, category = data[f"y_reg{suffix}"], data[f"y_cls{suffix}"]
    if form == "dict":
        return {"price": price, "category": category}
    if form == "per_member":
        return [[price, category] for _ in range(n)]
    return [price, category]


def _outputs_fit(form: str):
    def fit(data: dict, who: Who) -> dict:
        pack_form = form if who.is_pack else ("list" if form == "per_member" else form)
        return {
            "x": data["x"],
            "y": _labels(data, pack_form),
            "batch_size": 16,
            "epochs": 2,
            "shuffle": False,
            "verbose": 0,
            "validation_data": (data["x_val"], _labels(data, pack_form, "_val")),
        }

    return fit


def _outputs_eval(form: str):
    def evaluate(data: dict) -> tuple:
        return data["x_val"], _labels(data, "dict" if form == "dict" else "list", "_val")

    return evaluate


# Mixed precision (item 3) ----------------------------------------------------------------


@contextlib.contextmanager
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


# Members compiled beforehand (item 8) ----------------------------------------------------


def _own_optimizers_compile(i: int) -> dict:
    optimizer = keras.optimizers.SGD(0.1) if i == 0 else keras.optimizers.Adam(1e-2)
    return {"optimizer": optimizer, "loss": "mse", "metrics": ["mae"]}


def _loss_only(member_args: list[dict]) -> dict:
    return {"loss": "mse", "metrics": ["mae"]}


# Early stopping per member (item 10) -----------------------------------------------------


def _r2_compile(i: int) -> dict:
    return {**_regression_compile(i), "metrics": [keras.metrics.R2Score()]}


def _member_early_stopping(monitor: str):
    def callbacks(who: Who, folder) -> list:
        options = {"monitor": monitor, "patience": 1, "restore_best_weights": True}
        if who.is_pack:
            return [kg.callbacks.MemberEarlyStopping(**options)]
        return [keras.callbacks.EarlyStopping(**options)]

    return callbacks


def _long_regression_fit(data: dict, who: Who) -> dict:
    return {**_regression_fit(data, who), "epochs": 5}


# The matrix ------------------------------------------------------------------------------

CASES = {
    case.name: case
    for case in [
        _case(
            "basic",
            files=("csv", "tensorboard", "checkpoint"),
            callbacks=_file_callbacks,
            predict=True,
        ),
        _case(
            "sample_weight",
            fit=_sample_weight_fit,
            compile=_weighted_compile,
        ),
        _case(
            "class_weight_validation_split",
            fit=plain_fit(validation=False, validation_split=0.25, class_weight={0: 0.4, 1: 2.5}),
            engines=("fused",),
        ),
        _case("tf_data", fit=_tf_data_fit, engines=("fused",), tensorflow_only=True),
        _case(
            # Members with their own LearningRateSchedule, stopped by EarlyStopping.
            "schedule_early_stopping",
            compile=_schedule_compile,
            fit=plain_fit(epochs=4),
            callbacks=_early_stopping_callbacks,
            engines=("fused",),
        ),
        _case(
            "backup_and_restore",
            train=_backup_and_restore,
            files=("backup",),
            engines=("fused", "graph"),
        ),
        _case(
            "lr_scheduler",
            compile=_same_rate_compile,
            callbacks=_lr_scheduler_callbacks,
            fit=plain_fit(epochs=3),
            engines=("fused", "graph"),
        ),
        _case(
            "reduce_lr_on_plateau",
            compile=_same_rate_compile,
            callbacks=_reduce_lr_callbacks,
            fit=plain_fit(epochs=3),
            engines=("fused", "graph"),
        ),
        _case("fit_twice_save_load", train=_fit_twice_save_load, engines=("fused", "graph")),
        _case(
            "sparse_from_logits",
            build=_logits_mlp,
            compile=_logits_compile,
            fit=_classes_fit,
            evaluate=_classes_eval,
            predict=True,
            engines=("fused",),
        ),
        _case("subclassed", build=_subclassed, engines=("graph",), predict=True),
        _case(
            "dict_inputs",
            build=_two_inputs,
            fit=_two_inputs_fit,
            evaluate=_two_inputs_eval,
            predict=True,
            engines=("fused", "graph"),
        ),
        _case(
            "shard",
            fit=_shard_fit,
            pack_options={"data": "shard"},
            engines=("graph",),
            tensorflow_only=True,
        ),
        _case(
            "outputs_list",
            build=_two_outputs,
            compile=_list_outputs_compile,
            fit=_outputs_fit("list"),
            evaluate=_outputs_eval("list"),
            predict=True,
            engines=("fused", "graph"),
        ),
        _case(
            "outputs_per_member",
            build=_two_outputs,
            compile=_list_outputs_compile,
            fit=_outputs_fit("per_member"),
            evaluate=_outputs_eval("list"),
            engines=("fused", "graph"),
        ),
        _case(
            "outputs_dict",
            build=_two_dict_outputs,
            compile=_dict_outputs_compile,
            fit=_outputs_fit("dict"),
            evaluate=_outputs_eval("dict"),
            predict=True,
            engines=("fused", "graph"),
        ),
        _case(
            "mixed_float16",
            build=_linear_mlp,
            compile=_sgd_regression_compile,
            fit=_regression_fit,
            evaluate=_regression_eval,
            context=mixed_float16,
            # float16 activations: two equivalent computations round differently.
            atol=1e-3,
            rtol=1e-3,
            predict=True,
            engines=("fused", "graph"),
        ),
        _case(
            "compiled_members",
            compile=_own_optimizers_compile,
            fit=_regression_fit,
            evaluate=_regression_eval,
            precompile=True,
            pack_compile=_loss_only,
            engines=("fused", "graph"),
        ),
        _case(
            "member_early_stopping",
            compile=_regression_compile,
            fit=_long_regression_fit,
            evaluate=_regression_eval,
            callbacks=_member_early_stopping("val_loss"),
            engines=("fused", "graph"),
        ),
        _case(
            "member_early_stopping_r2",
            compile=_r2_compile,
            fit=_long_regression_fit,
            evaluate=_regression_eval,
            callbacks=_member_early_stopping("val_r2_score"),
            engines=("fused",),
        ),
    ]
}


# Per-batch callbacks with the default steps_per_execution (item 9) -------------------------


class BatchLog(keras.callbacks.Callback):
    """Writes the batch index of every `on_train_batch_end` call to `path`, one a line."""

    def __init__(self, path) -> None:
        super().__init__()
        self.path = path
        self.batches: list[int] = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(int(batch))

    def on_train_end(self, logs=None):
        self.path.write_text("\n".join(map(str, self.batches)))


def _batch_callbacks(who: Who, folder) -> list:
    return [
        BatchLog(folder / "batches.txt"),
        keras.callbacks.ModelCheckpoint(
            str(folder / "batch_ckpt" / "{epoch:02d}-{batch:02d}.weights.h5"),
            save_weights_only=True,
            save_freq=5,
        ),
    ]


CASES["batch_callbacks"] = _case(
    "batch_callbacks",
    callbacks=_batch_callbacks,
    files=("batches",),
    evaluate=None,
    engines=("fused", "graph"),
)


# Every built-in optimizer (item 4) -------------------------------------------------------

# Wrappers are left out: LossScaleOptimizer is the mixed_float16 case, MultiOptimizer
# takes a map of optimizers.
OPTIMIZERS = sorted(
    name
    for name in dir(keras.optimizers)
    if isinstance(getattr(keras.optimizers, name), type)
    and issubclass(getattr(keras.optimizers, name), keras.optimizers.Optimizer)
    and name not in ("Optimizer", "LossScaleOptimizer", "MultiOptimizer")
)
VECTORIZED = (
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Ftrl",
    "Lamb",
    "Lion",
    "Nadam",
    "RMSprop",
    "SGD",
)


def _optimizer_compile(name: str):
    def compile(i: int) -> dict:
        optimizer = getattr(keras.optimizers, name)(learning_rate=(0.01, 0.02)[i])
        return {"optimizer": optimizer, "loss": "binary_crossentropy"}

    return compile


def _ema_compile(i: int) -> dict:
    optimizer = keras.optimizers.Adam((0.01, 0.02)[i], use_ema=True, ema_momentum=0.5)
    return {"optimizer": optimizer, "loss": "binary_crossentropy", "metrics": ["accuracy"]}


def _mixed_families_compile(i: int) -> dict:
    optimizer = keras.optimizers.Adam(0.01) if i == 0 else keras.optimizers.SGD(0.1)
    return {"optimizer": optimizer, "loss": "binary_crossentropy", "metrics": ["accuracy"]}


for _name in OPTIMIZERS:
    CASES[f"optimizer_{_name}"] = _case(
        f"optimizer_{_name}",
        compile=_optimizer_compile(_name),
        fit=plain_fit(epochs=1, validation=False),
        evaluate=None,
        engines=("fused",),
        must_fuse=True,
    )
CASES["optimizer_ema"] = _case(
    "optimizer_ema",
    compile=_ema_compile,
    fit=plain_fit(epochs=1, validation=False),
    evaluate=None,
    engines=("fused", "graph"),
)
CASES["optimizer_families"] = _case(
    "optimizer_families",
    compile=_mixed_families_compile,
    fit=plain_fit(epochs=1, validation=False),
    evaluate=None,
    engines=("fused",),
)


# How fit reads the data (issue 24 items 1 and 2) -------------------------------------------


def _steps_per_epoch_fit(data: dict, who: Who) -> dict:
    # 6 batches of training data: 2 an epoch, 3 epochs; 2 validation batches.
    return {
        **plain_fit(epochs=3)(data, who),
        "steps_per_epoch": 2,
        "validation_steps": 2,
    }


def _endless_batches(data: dict):
    while True:
        for start in range(0, ROWS, 16):
            yield data["x"][start : start + 16], data["y"][start : start + 16]


def _generator_fit(data: dict, who: Who) -> dict:
    kwargs = plain_fit(epochs=2)(data, who)
    del kwargs["y"], kwargs["batch_size"]
    return {**kwargs, "x": _endless_batches(data), "steps_per_epoch": 4}


class Batches(keras.utils.PyDataset):
    """The training rows in batches of 16, counting the batches it is asked for."""

    def __init__(self, data: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.x, self.y = data["x"], data["y"]
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x) // 16

    def __getitem__(self, index: int):
        self.reads += 1
        return self.x[index * 16 : (index + 1) * 16], self.y[index * 16 : (index + 1) * 16]


def _py_dataset_fit(data: dict, who: Who) -> dict:
    kwargs = plain_fit(epochs=2)(data, who)
    del kwargs["y"], kwargs["batch_size"]
    return {**kwargs, "x": Batches(data, workers=2)}


CASES["steps_per_epoch"] = _case("steps_per_epoch", fit=_steps_per_epoch_fit)
CASES["generator_steps_per_epoch"] = _case("generator_steps_per_epoch", fit=_generator_fit)
CASES["py_dataset_workers"] = _case("py_dataset_workers", fit=_py_dataset_fit)


@dataclasses.dataclass(frozen=True)
class Known:
    """A cell of the matrix that fails today: strict xfail with `reason`."""

    reason: str
    cases: tuple[str, ...] = ()  # () = every case
    engines: tuple[str, ...] = ()  # () = every engine
    aspects: tuple[str, ...] = ()  # () = every aspect (the whole run fails)
    backends: tuple[str, ...] = ()  # () = every backend


_TRAINED = ("weights", "history", "callbacks", "evaluate_dict", "predict")
_NOT_VECTORIZED = tuple(f"optimizer_{name}" for name in OPTIMIZERS if name not in VECTORIZED)

KNOWN_FAILURES: list[Known] = [
    Known(
        "issue 12 item 4: fuse='auto' does not train this optimizer fused (graph engine on "
        "TensorFlow, TypeError in fit on JAX)",
        cases=_NOT_VECTORIZED,
        aspects=("fused",),
    ),
    Known(
        "issue 12 item 4: on JAX, an optimizer without a vectorized form (or mixed families) "
        "switches to the TensorFlow-only graph engine and fit raises TypeError",
        cases=(*_NOT_VECTORIZED, "optimizer_ema"),
        backends=("jax", "torch"),
    ),
]


_FILE_ASPECTS = {
    "csv": ("csv",),
    "tensorboard": ("tensorboard",),
    "checkpoint": ("checkpoint",),
    "backup": ("backup",),
    "batches": ("batches", "batch_checkpoints"),
}


def case_aspects(case: Case) -> list[str]:
    """The aspects compared for `case`: each is one test of the matrix."""
    aspects = ["weights", "history", "callbacks"]
    if case.evaluate is not None:
        aspects += ["evaluate_dict", "evaluate_list"]
    if case.predict:
        aspects.append("predict")
    if case.must_fuse:
        aspects.append("fused")
    for name in case.files:
        aspects.extend(_FILE_ASPECTS[name])
    return aspects


def known_failure(case: str, engine: str, aspect: str, backend: str = BACKEND) -> str | None:
    """The reason `(case, engine, aspect)` fails today on `backend`, or None."""
    for known in KNOWN_FAILURES:
        if (
            (not known.cases or case in known.cases)
            and (not known.engines or engine in known.engines)
            and (not known.aspects or aspect in known.aspects)
            and (not known.backends or backend in known.backends)
        ):
            return known.reason
    return None


# The runs `make test` leaves to `make test-all` (`slow`): each repeats code that another run
# of `make test` compares with plain Keras on the same backend. Members of other widths
# (padded) read the data as same-width members do; on TensorFlow and JAX every vectorized
# optimizer's steps are compared with each member's own optimizer in
# tests/pack/fusion/test_vectorized_optimizer.py, so the matrix keeps one optimizer of each
# kind there (torch, which does not run that file, keeps every optimizer case).
_DATA_READS = ("steps_per_epoch", "generator_steps_per_epoch", "py_dataset_workers")
_OPTIMIZERS_IN_MAKE_TEST = ("optimizer_Adam", "optimizer_Adafactor")


def in_make_test(case: Case, engine: str, backend: str = BACKEND) -> bool:
    """Whether `(case, engine)` runs in `make test` on `backend` (else only in test-all)."""
    if engine == "widths" and case.name in _DATA_READS:
        return False
    single_optimizer = case.name.removeprefix("optimizer_") in OPTIMIZERS
    return not single_optimizer or backend == "torch" or case.name in _OPTIMIZERS_IN_MAKE_TEST


def skip_reason(case: Case, engine: str, backend: str = BACKEND) -> str | None:
    """Why `(case, engine)` does not run on `backend`, or None."""
    if engine == "graph" and backend != "tensorflow":
        return "the graph engine (fuse=False) runs on TensorFlow only"
    if case.tensorflow_only and backend != "tensorflow":
        return f"{case.name}: a TensorFlow-only feature"
    return None
