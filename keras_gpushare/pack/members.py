"""Member bookkeeping for `ModelPack`: validation and per-member arguments."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import keras
from keras import tree

from keras_gpushare import _upstream


def check_members(members: Any) -> list[keras.Model]:
    """Returns `members` as a list, or raises naming the member that is not a Keras model."""
    if isinstance(members, keras.Model) or not isinstance(members, Sequence):
        raise TypeError(
            "Invalid value for argument `members`: expected a list of `keras.Model` "
            f"instances, got {type(members).__name__}. Pass `[model_a, model_b, ...]` or use "
            "`ModelPack.from_builder(build_fn, n=...)`."
        )
    members = list(members)
    if not members:
        raise ValueError(
            "Invalid value for argument `members`: the list is empty. A ModelPack needs at "
            "least one member model."
        )
    for i, member in enumerate(members):
        if not isinstance(member, keras.Model):
            raise TypeError(
                f"Invalid member {i}: expected a `keras.Model`, got {type(member).__name__} "
                f"({member!r:.80}). Wrap layers in `keras.Sequential([...])` or a Functional "
                "model first."
            )
        if is_pack(member):
            raise TypeError(f"Invalid member {i}: a ModelPack cannot be a member of a ModelPack.")
    for i, member in enumerate(members):
        own = [
            name
            for name in ("train_step", "test_step")
            if getattr(type(member), name) is not getattr(keras.Model, name)
        ]
        if own:
            raise ValueError(
                f"Invalid member {i}: `{type(member).__name__}` writes its own "
                f"{' and '.join(f'`{name}`' for name in own)}, and a ModelPack trains and "
                "evaluates its members with its own step (every member's loss, gradients and "
                "update in one). Move the custom logic to `compute_loss` (the graph engine "
                "calls it) or train this model alone."
            )
    seen: dict[int, int] = {}
    for i, member in enumerate(members):
        if id(member) in seen:
            raise ValueError(
                f"Invalid value for argument `members`: member {i} is the same model object "
                f"as member {seen[id(member)]}. Each member must be its own model; build a "
                "new one (or use `keras.models.clone_model`)."
            )
        seen[id(member)] = i
    return members


def is_pack(model: Any) -> bool:
    """Whether `model` is a `ModelPack`.

    The class is looked up where Keras registers it rather than imported: the pack's own
    module imports this one. No pack exists before that module registers the class.
    """
    pack_class = keras.saving.get_registered_object("keras_gpushare>ModelPack")
    return pack_class is not None and isinstance(model, pack_class)


def member_optimizers(optimizer: Any, n: int) -> list[keras.optimizers.Optimizer]:
    """Returns one optimizer instance per member, never sharing state between members.

    One optimizer (a name or an instance) is copied for each member, so member `i`'s copy is
    named `m{i}_<name>`; a list gives member `i` the `i`-th optimizer as it is.
    """
    if not isinstance(optimizer, (list, tuple)):
        base = _get_optimizer(optimizer, "all members")
        return [clone_optimizer(base, name=f"m{i}_{base.name}") for i in range(n)]
    if len(optimizer) != n:
        raise ValueError(
            f"Invalid value for argument `optimizer`: got {len(optimizer)} optimizers for {n} "
            f"members. Pass one optimizer for all members or a list of {n}."
        )
    check_distinct_optimizers(optimizer)
    return [_get_optimizer(value, f"member {i}") for i, value in enumerate(optimizer)]


def check_distinct_optimizers(optimizers: Sequence[Any]) -> None:
    """Raises when two members would share one optimizer instance (and so its state)."""
    seen: dict[int, int] = {}
    for i, value in enumerate(optimizers):
        if id(value) in seen and isinstance(value, keras.optimizers.Optimizer):
            raise ValueError(
                f"Invalid value for argument `optimizer`: member {i} and member "
                f"{seen[id(value)]} got the same optimizer instance. Optimizer state (slots, "
                "step count) is per member: pass a new instance for each member, or one "
                "optimizer for all members and the pack copies it per member."
            )
        seen[id(value)] = i


def _get_optimizer(value: Any, who: str) -> keras.optimizers.Optimizer:
    if value is None:
        raise ValueError(
            f"Invalid optimizer for {who}: got None. Pass an optimizer name such as "
            '"adam" or a `keras.optimizers.Optimizer` instance.'
        )
    try:
        return keras.optimizers.get(value)
    except ValueError as e:
        raise ValueError(f"Invalid optimizer for {who}: {e}") from None


def clone_optimizer(
    optimizer: keras.optimizers.Optimizer, name: str | None = None
) -> keras.optimizers.Optimizer:
    """Returns a fresh optimizer with `optimizer`'s configuration and no state."""
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return optimizer.__class__.from_config(config)


def member_losses(loss: Any, n: int, output_counts: Sequence[int | None]) -> list:
    """Returns per-member loss specs.

    A list with one loss per output of every member (`["mse", "sparse_categorical_crossentropy"]`
    for members with two outputs) is shared by all members, as `keras.Model.compile` reads
    it; otherwise a list of `n` is per member (an entry may itself be a list or dict of
    per-output losses); any other value is shared as it is.
    """
    if not isinstance(loss, (list, tuple)):
        return [loss] * n
    per_output = all(count == len(loss) for count in output_counts)
    flat = not any(isinstance(item, (list, tuple, dict)) for item in loss)
    if per_output and flat and any(count is not None for count in output_counts):
        return [loss] * n
    if len(loss) == n and n > 1:
        return list(loss)
    if per_output:
        return [loss] * n
    raise ValueError(
        f"Invalid value for argument `loss`: got a list of {len(loss)} losses for {n} members "
        f"with {list(output_counts)} outputs. Pass one loss for all members, a list of {n} "
        "(one per member), or a list with one loss per output shared by all members."
    )


def standalone_copy(member: keras.Model) -> keras.Model:
    """A copy of `member` sharing nothing with it: weights, compile settings, optimizer state.

    Every layer's state reaches the copy as a `.keras` save and reload carries it, not only
    the variables `set_weights` writes (see `_copy_layer_state`).
    """
    compiled = member.compiled
    # `clone_model` compiles its clone from the serialized compile settings, which a loss or
    # metric not registered with Keras cannot come back from: the copy is compiled below.
    member.compiled = False
    try:
        copy = keras.models.clone_model(member)
    finally:
        member.compiled = compiled
    _copy_layer_state(member, copy)
    if compiled:
        copy.compile(**_compile_arguments_for_a_copy(member))
        copy.optimizer.build(copy.trainable_variables)
        if member.optimizer.built:
            for dst, src in zip(copy.optimizer.variables, member.optimizer.variables):
                dst.assign(src)
    return copy


def _compile_arguments_for_a_copy(member: keras.Model) -> dict:
    """What `member` was compiled with, for a copy that shares no state with it.

    Keras's own serialized form where it comes back (registered objects, Keras's own); else
    the objects `compile` was given, as plain Keras takes an unregistered loss or metric: the
    loss shared (a function), every metric and the optimizer made anew from their configs.
    """
    try:
        return keras.saving.deserialize_keras_object(member.get_compile_config())
    except (TypeError, ValueError):
        pass
    config = _upstream.compile_arguments(member)
    optimizer = config.get("optimizer")
    if isinstance(optimizer, keras.optimizers.Optimizer):
        config["optimizer"] = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    for key in ("metrics", "weighted_metrics"):
        config[key] = tree.map_structure(
            lambda m: clone_metric(m, 1) if isinstance(m, keras.metrics.Metric) else m,
            config.get(key),
        )
    return config


def clone_metric(metric: keras.metrics.Metric, n: int) -> keras.metrics.Metric:
    """A fresh metric configured as `metric`, with its own state: `from_config(get_config())`
    of its class.

    Made without Keras's serialization registry: the functions and classes the metric holds
    (a `MeanMetricWrapper`'s function) resolve by name from the metric itself, so an
    unregistered metric copies as a registered one does. A copy that differs from `metric`
    in a plain attribute (a constructor argument that `get_config` leaves out) is refused.

    Raises:
        ValueError: when the copy cannot be made faithfully, with the way out.
    """
    cls = type(metric)
    held = {
        value.__name__: value
        for value in vars(metric).values()
        if callable(value) and hasattr(value, "__name__")
    }
    call = f"`{cls.__name__}.from_config(metric.get_config())`"
    try:
        with keras.saving.custom_object_scope(held):
            clone = cls.from_config(metric.get_config())
    except (TypeError, ValueError) as e:
        problem = f"{call} raised {e!r}"
    else:
        lost = sorted(
            key
            for key, value in vars(metric).items()
            if isinstance(value, (bool, int, float, str, type(None)))
            and key not in ("built", "_built")
            and vars(clone).get(key, value) != value
        )
        if not lost:
            return clone
        problem = f"the copy {call} makes differs in {lost}"
    raise ValueError(
        f"Invalid value for argument `metrics`: one `{cls.__name__}` object ({metric.name!r}) "
        "goes to more than one member, and each member needs its own metric state, but it "
        f"cannot be copied: {problem}. Return every constructor argument from "
        f"`{cls.__name__}.get_config()`, or pass one metric object per member: "
        f"`metrics=[[{cls.__name__}(...)] for _ in range({n})]`."
    )


def _copy_layer_state(source: keras.Model, target: keras.Model) -> None:
    """Writes each layer's state in `source` into the same layer of its clone `target`.

    State goes through Keras's own save-format hooks, layer by layer: `save_own_variables` /
    `load_own_variables`, then `save_assets` / `load_assets`. `set_weights` alone writes the
    variables and nothing derived from them or kept beside them: an adapted `Normalization`
    would keep its default mean and variance (its `load_own_variables` remakes them), a
    `StringLookup`, `IntegerLookup` or `TextVectorization` its empty vocabulary (an asset).
    """
    pairs = zip(_upstream.all_layers(source), _upstream.all_layers(target), strict=True)
    with tempfile.TemporaryDirectory() as assets:
        for k, (src, dst) in enumerate(pairs):
            store: dict[str, Any] = {}
            src.save_own_variables(store)
            dst.load_own_variables({key: _to_numpy(value) for key, value in store.items()})
            if hasattr(src, "save_assets"):
                path = os.path.join(assets, str(k))
                os.mkdir(path)
                src.save_assets(path)
                dst.load_assets(path)


def _to_numpy(value: Any) -> Any:
    """A stored value as a `.keras` file holds it: an array, never the source's variable."""
    return keras.ops.convert_to_numpy(value) if isinstance(value, keras.Variable) else value


def build_member(member: keras.Model, data_batch: Any, build_optimizer: bool = True) -> None:
    """Builds `member`'s compiled loss, metrics and optimizer for batches like `data_batch`.

    Keras's `_symbolic_build` traces the model, its metrics and its loss on symbolic inputs
    (on TensorFlow, a scratch graph of every operation, for each member: 0.1-0.3 s a member
    with confusion-matrix metrics). A built member with a layer graph knows its outputs'
    shapes, and compiled losses and metrics are built from them; only where a metric may
    make its state from the first values it sees (an F1 score, R2, a user's metric class)
    are the metrics' updates traced on symbolic labels and outputs, the model not. Models
    without a layer graph take Keras's way. The optimizer is then built as Keras builds it, unless
    `build_optimizer` is `False` and nothing else needs Keras's build: a fused member's
    optimizer holds no state while the pack trains, and is built when the member's state
    is written back (`pack.members`, `pack.member(i)`).
    """
    outputs = _output_specs(member)
    if outputs is not None:
        y = keras.utils.unpack_x_y_sample_weight(data_batch)[1]
        y = tree.map_structure(_symbolic, y)
        names = list(getattr(member, "output_names", None) or [])
        if isinstance(y, dict) and isinstance(outputs, (list, tuple)) and set(y) == set(names):
            # Labels by output name for a model of listed outputs, as Keras's loss takes them.
            y = [y[name] for name in names]
        metrics = _upstream.compile_metrics(member)
        if metrics is not None and not metrics.built:
            metrics.build(y, outputs)
            _make_metric_state(metrics, y, outputs, data_batch)
        loss = _upstream.compile_loss(member)
        if loss is not None and not loss.built:
            loss.build(y, outputs)
        if not build_optimizer and all(c is None or c.built for c in (metrics, loss)):
            return
    _upstream.symbolic_build(member, data_batch)


def _output_specs(member: keras.Model) -> Any:
    """Symbolic tensors shaped as a built `member`'s outputs, in its call's structure, or
    None when it has no layer graph."""
    graph = member
    if isinstance(member, keras.Sequential):
        graph = _upstream.sequential_graph(member)
    if not member.built or graph is None or not _upstream.has_layer_graph(graph):
        return None
    return tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, t.dtype), _upstream.outputs_struct(graph)
    )


def _make_metric_state(metrics: Any, y: Any, outputs: Any, data_batch: Any) -> None:
    """Makes the state of a built `CompileMetrics`'s metrics that make it from their first
    batch, by tracing their updates on symbolic labels and outputs (for one output, those
    metrics' updates alone; otherwise every metric's, as Keras's build does)."""
    pending = [metric for metric in metrics.metrics if not _state_made(metric)]
    if not pending:
        return
    labels, predictions = tree.flatten(y), tree.flatten(outputs)
    if len(predictions) == 1 and len(labels) == 1 and labels[0] is not None:

        def update(y_true: Any, y_pred: Any) -> None:
            for metric in pending:
                metric.update_state(y_true, y_pred)

        _upstream.trace_symbolically(update, _rows_unknown(labels[0]), predictions[0])
        return
    weights = keras.utils.unpack_x_y_sample_weight(data_batch)[2]
    _upstream.trace_symbolically(
        metrics.update_state,
        tree.map_structure(_rows_unknown, y),
        outputs,
        tree.map_structure(_rows_unknown, weights),
    )


def _state_made(metric: keras.metrics.Metric) -> bool:
    """Whether `metric` holds all its state before it sees a batch: the means of a function
    of each batch and Keras's own metrics do, but for those that shape it from their first
    batch (`_upstream.metric_state_pending`); a user's metric class is not known to."""
    if isinstance(metric, keras.metrics.MeanMetricWrapper):
        return True
    keras_own = _upstream.is_keras_builtin(type(metric), "metrics")
    return keras_own and not _upstream.metric_state_pending(metric)


def _symbolic(value: Any) -> Any:
    return None if value is None else keras.KerasTensor(value.shape, _dtype(value))


def _rows_unknown(value: Any) -> Any:
    """`value` (symbolic) with its rows unknown, as in the outputs of a model's layer graph
    (torch fills each unknown size with one number, which must agree)."""
    return None if value is None else keras.KerasTensor((None, *value.shape[1:]), _dtype(value))


def _dtype(value: Any) -> str:
    return keras.backend.standardize_dtype(value.dtype)
