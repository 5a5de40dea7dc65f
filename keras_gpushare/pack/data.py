"""How a pack's batch reaches its members: `replicate` (all see it) or `shard` (a slice each)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops, tree

from keras_gpushare import _upstream

DATA_MODES = ("replicate", "shard")


def check_data_mode(data: Any) -> str:
    """Returns `data` if it is a known mode, or raises naming the accepted ones."""
    if data not in DATA_MODES:
        raise ValueError(
            f'Invalid value for argument `data`: got {data!r}. Expected "replicate" (every '
            'member sees each batch) or "shard" (member i trains on rows i, i+N, ... of each '
            "batch)."
        )
    return data


def labels_per_member(y: Any, output_counts: Sequence[int | None]) -> bool:
    """True when `y` holds one label structure per member, False when all share `y`.

    `y` is per member when it is a list or tuple of N entries, each of which can label its
    member's outputs (a single array for a one-output member, a list or dict of labels for
    a member with several). A list of labels for the outputs of multi-output members, shared
    by all (`y=[y_price, y_category]`), is not per member even when N equals the number of
    outputs. `output_counts` gives each member's output count (`None` when unknown).
    """
    n = len(output_counts)
    if isinstance(y, RowShards):
        return True
    if n < 2 or not isinstance(y, (list, tuple)) or len(y) != n:
        return False
    return all(_labels_fit(label, count) for label, count in zip(y, output_counts))


def _labels_fit(label: Any, count: int | None) -> bool:
    """Whether `label` can label a member with `count` outputs."""
    if count is None:
        return True
    nested = isinstance(label, (list, tuple, dict))
    if count == 1:
        return not nested or len(label) == 1
    return nested and len(label) == count


def member_labels(y: Any, i: int, per_member: bool) -> Any:
    """Member `i`'s labels (or sample weights) out of the pack's."""
    if y is None:
        return None
    return y[i] if per_member else y


def member_inputs(x: Any, member: keras.Model) -> Any:
    """Member `i`'s inputs: a dict is narrowed to the inputs the member names."""
    if isinstance(x, dict):
        names = input_names(member)
        if names and all(name in x for name in names):
            if len(names) == 1 and not _takes_dict(member):
                return x[names[0]]
            return {name: x[name] for name in names}
    return x


def input_names(member: keras.Model) -> list[str]:
    """Names of a Functional/Sequential member's inputs ([] for subclassed models)."""
    try:
        inputs = member.inputs
    except (AttributeError, ValueError):
        return []
    if not inputs:
        return []
    names = (getattr(t, "name", None) for t in inputs)
    return [name for name in names if name]


def _takes_dict(member: keras.Model) -> bool:
    return isinstance(_upstream.inputs_struct(member), dict)


def shard_rows(value: Any, i: int, n: int) -> Any:
    """Rows `i, i+n, i+2n, ...` of every array in `value` (the seeds' `x[i::n]`)."""
    if value is None:
        return None
    return tree.map_structure(lambda t: t[i::n], value)


def uneven_shard_error(what: str, n: int) -> ValueError:
    """The error for `data="shard"` batches that do not split evenly among the `n` fused
    members; `what` names the batch (`"batch_size=25"`, `"a last batch of 4 rows"`)."""
    return ValueError(
        f'Invalid batch for data="shard" on the fused engine: {what} does not split evenly '
        f"among the {n} members. Pass a `batch_size` that is a multiple of {n} and a number "
        "of samples whose last batch is one too, or (TensorFlow) `fuse=False`, whose graph "
        "engine gives the first members one row more."
    )


def dealt(value: Any, n: int) -> Any:
    """Every member's `shard_rows` of `value` at once, each array `(n, rows / n, ...)`:
    one reshape, for a batch whose rows split evenly among the `n` members."""

    def deal(t: Any) -> Any:
        rest = tuple(t.shape[1:])
        return ops.swapaxes(ops.reshape(t, (-1, n) + rest), 0, 1)

    return tree.map_structure(deal, value)


class RowShards:
    """A `data="shard"` training batch's labels (or sample weights) as the members take
    them: `shards[i]` is member i's rows (`shard_rows`), `shards.stacked()` all members'
    at once (`dealt`). The batch's rows split evenly among the `n` members.

    Args:
        value: the batch's labels or sample weights.
        n: the number of members.
    """

    def __init__(self, value: Any, n: int) -> None:
        self.value = value
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return shard_rows(self.value, i, self.n)

    def stacked(self) -> Any:
        return dealt(self.value, self.n)


def output_count(member: keras.Model) -> int | None:
    """Number of outputs of a Functional member, or None when it cannot be known."""
    try:
        outputs = member.outputs
    except (AttributeError, ValueError):
        return None
    return len(outputs) if outputs else None


def check_label_structure(y: Any, i: int, member: keras.Model) -> None:
    """Raises when member `i`'s labels cannot match its outputs."""
    count = output_count(member)
    if y is None or count is None:
        return
    if isinstance(y, dict):
        names = getattr(member, "output_names", None) or []
        missing = [k for k in names if k not in y]
        if count > 1 and missing:
            raise ValueError(
                f"Invalid labels for member {i} ({member.name}): its outputs are named "
                f"{names} but the label dict has keys {sorted(y)}. Pass a dict with a key per "
                "output, or a list of labels in output order."
            )
        return
    given = len(y) if isinstance(y, (list, tuple)) else 1
    if given != count:
        raise ValueError(
            f"Invalid labels for member {i} ({member.name}): it has {count} output(s) but got "
            f"{given} label array(s). Pass {count} label array(s) for this member; for a pack "
            "of members with different labels pass `y=[y_member0, y_member1, ...]` (one entry "
            "per member)."
        )


def member_batches(
    data: Any,
    members: Sequence[keras.Model],
    member_ids: Sequence[int],
    output_counts: Sequence[int | None],
    shard: bool,
) -> list[tuple[Any, Any, Any]]:
    """Splits a pack batch into `(x, y, sample_weight)` for each of `members`.

    Args:
        data: the pack's batch.
        members: the members to serve, in `member_ids` order.
        member_ids: their positions in the pack.
        output_counts: every member's output count (see `labels_per_member`).
        shard: give member `i` rows `i, i+N, ...` only (`data="shard"` in training).
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    targets = member_targets(y, sample_weight, output_counts)
    n = len(output_counts)
    batches = []
    for member, i in zip(members, member_ids):
        xi = member_inputs(x, member)
        yi, swi = targets[i]
        if shard:
            xi, yi, swi = (shard_rows(v, i, n) for v in (xi, yi, swi))
        batches.append((xi, yi, swi))
    return batches


def member_targets(
    y: Any, sample_weight: Any, output_counts: Sequence[int | None]
) -> list[tuple[Any, Any]]:
    """Each member's `(labels, sample_weight)`: split when `y` holds one entry per member."""
    n = len(output_counts)
    per_member = labels_per_member(y, output_counts)
    weights_per_member = per_member and _is_list_of(sample_weight, n)
    return [
        (member_labels(y, i, per_member), member_labels(sample_weight, i, weights_per_member))
        for i in range(n)
    ]


def _is_list_of(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple, RowShards)) and len(value) == n


def check_label_ranges(y: Any, members: Sequence[keras.Model]) -> None:
    """Raises, as Keras does on TensorFlow, when sparse labels fall outside a member's classes.

    Keras's TensorFlow kernel rejects a sparse label outside `[0, classes)`, where XLA and the
    fused engine would silently make the loss NaN (the pack checks on TensorFlow only: on
    JAX and torch plain Keras trains on such labels). Labels held in arrays are checked
    before any work; labels inside a dataset are not (a member whose loss turns NaN is then
    frozen, with a warning).
    """
    if y is None or hasattr(y, "element_spec"):
        return
    counts = [output_count(m) for m in members]
    per_member = labels_per_member(y, counts)
    for i, member in enumerate(members):
        labels = member_labels(y, i, per_member)
        classes, ignore = _sparse_classes(member)
        if classes is None or isinstance(labels, (list, tuple, dict)) or labels is None:
            continue
        try:
            values = np.asarray(keras.ops.convert_to_numpy(labels))
        except (TypeError, ValueError):
            continue
        if not np.issubdtype(values.dtype, np.number) or values.size == 0:
            continue
        if ignore is not None:
            values = values[values != ignore]
        bad = values[(values < 0) | (values >= classes)]
        if bad.size:
            raise ValueError(
                f"Invalid labels for member {i} ({member.name}): received a label value of "
                f"{bad.flat[0]:g} which is outside the valid range of [0, {classes}) of its "
                f"sparse categorical loss ({classes} outputs). Pass labels 0 to {classes - 1}."
            )


def _sparse_classes(member: keras.Model) -> tuple[int | None, int | None]:
    """`(classes, ignore_class)` when `member` has one output and a sparse categorical loss."""
    if not member.compiled or output_count(member) != 1:
        return None, None
    loss = member.loss
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    if isinstance(loss, dict) and len(loss) == 1:
        loss = next(iter(loss.values()))
    try:
        loss = keras.losses.get(loss)
    except (TypeError, ValueError):
        return None, None
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        ignore = loss.ignore_class
    elif loss is keras.losses.sparse_categorical_crossentropy:
        ignore = None
    else:
        return None, None
    classes = member.outputs[0].shape[-1]
    return (int(classes), ignore) if classes else (None, None)


def check_array_data(argument: str, value: Any) -> None:
    """Raises, in one line, when `value` (`x` or `y`) is a Python list, tuple or dict
    holding numbers where Keras expects arrays (`x.tolist()`, say).

    Keras's data adapters cannot slice a Python number, and refuse such data by printing it
    whole (plain Keras), or read each number as an input of its own. A list or dict of
    arrays, Keras's form for several inputs or outputs, passes.
    """
    if not isinstance(value, (list, tuple, dict)):
        return
    if not any(_is_number(leaf) for leaf in tree.flatten(value)):
        return
    part = "input" if argument == "x" else "output"
    raise ValueError(
        f"Invalid value for argument `{argument}`: got {_python_data(value)}. Expected "
        f"NumPy arrays or tensors (e.g. `np.asarray({argument})`), a `tf.data.Dataset`, a "
        f"`keras.utils.PyDataset` or a generator (for members with several {part}s, a list "
        f"or dict of arrays, one per {part})."
    )


def _is_number(leaf: Any) -> bool:
    return isinstance(leaf, (bool, int, float, complex, np.generic))


def _python_data(value: Any) -> str:
    """What a Python list or tuple of numbers (or of rows of numbers) holds, in words."""
    kind = f"a Python {type(value).__name__}"
    items = list(value.values()) if isinstance(value, dict) else list(value)
    if all(_is_number(item) for item in items):
        return f"{kind} of {len(items)} numbers"
    widths = {len(item) if isinstance(item, (list, tuple)) else -1 for item in items}
    rows_of_numbers = all(
        isinstance(item, (list, tuple)) and all(_is_number(v) for v in item) for item in items
    )
    if rows_of_numbers and len(widths) == 1:
        width = widths.pop()
        return f"{kind} of {len(items)} rows of {width} value{'' if width == 1 else 's'}"
    return f"{kind} holding Python numbers where arrays belong"


def check_member_inputs(x: Any, members: Sequence[keras.Model]) -> None:
    """Raises, naming the member, when a member's layers cannot take the inputs `x`.

    `x` holds arrays, tensors or a dataset's `tf.TensorSpec`s. A member is checked only
    where `x` has a shape its `keras.Input` does not (a known size differs, or the rank),
    and only refused when its own layers then fail on that shape, as they would in its own
    `fit`: a member whose layers take any size is left to Keras.
    """
    for i, member in enumerate(members):
        inputs = _member_inputs_or_none(member)
        if inputs is None:
            continue
        given = member_inputs(x, member)
        _check_input_count(given, inputs, i, member, members)
        for argument, leaf, expected in _paired_inputs(given, inputs):
            if isinstance(x, dict) and not isinstance(given, dict):
                argument = f"`x[{expected.name!r}]`"
            shape = _dense_shape(leaf)
            reference = tuple(expected.shape)
            if shape is None or not _differs(shape, reference):
                continue
            call = functools.partial(member.call, training=False)
            failure = _trace_failure(call, tree.map_structure(_symbolic, given))
            if failure is None:
                break
            raise ValueError(
                f"Invalid inputs for member {i} ({member.name}): argument {argument} has "
                f"shape {shape}, but the member's `keras.Input` there has shape {reference} "
                "(None: any size). Pass inputs of that shape for this member."
            ) from failure


def _check_input_count(
    given: Any, inputs: list, i: int, member: keras.Model, members: Sequence[keras.Model]
) -> None:
    """Raises when a list of inputs holds another number of arrays than `member` has
    `keras.Input`s: Keras would refuse it inside the step, naming internal layers.

    A pack hands every member the same `x` (a dict narrowed to each member's input names),
    so a list of one entry per member (`x=[x_0, x_1]`, as `y=[y_0, y_1]` is) is refused
    here, naming the accepted forms; for one member with several inputs the list is its own
    multi-input form.
    """
    if not isinstance(given, (list, tuple)):
        return
    leaves = tree.flatten(given)
    if len(leaves) == len(inputs):
        return
    shapes = [_dense_shape(leaf) for leaf in leaves]
    expected = {t.name: tuple(t.shape) for t in inputs}
    names = sorted({name for other in members for name in input_names(other)})
    raise ValueError(
        f"Invalid inputs for member {i} ({member.name}): `x` is a list of {len(leaves)} "
        f"arrays of shapes {shapes}, but the member has {len(inputs)} `keras.Input`(s), "
        f"{expected} (name: shape; None: any size). A pack gives every member the same "
        "`x`; one `x` per member (`x=[x_0, x_1, ...]`) is not a form it takes. Pass inputs "
        "that every member takes as its own `fit` would, or, for members that read "
        "different inputs, a dict keyed by the members' `keras.Input` names, from which "
        f"each member reads its own keys (the members' input names: {names}; name inputs "
        "that carry different data differently)."
    )


def check_member_labels(x: Any, y: Any, members: Sequence[keras.Model], per_member: bool) -> None:
    """Raises, naming the member, when labels cannot reach a member's outputs and loss.

    `per_member` says whether `y` holds one entry per member (`labels_per_member`). Each
    member's labels must match its outputs' structure (`check_label_structure`).
    Per-member labels (`y=[y0, y1, ...]`) must have one row per sample of `x`. The labels
    of each output are compared with the output's shape through the member's loss, when it
    is one of Keras's own: the pack refuses them only where that loss fails on the two
    shapes, as it would in the member's own `fit` (a loss that broadcasts `(n, 1)` labels
    takes them; a sparse loss takes class indices). Custom losses are left to Keras.
    """
    if y is None:
        return
    for i, member in enumerate(members):
        check_label_structure(member_labels(y, i, per_member), i, member)
    rows = None if hasattr(x, "element_spec") else _rows(x)
    traced: dict = {}
    for i, member in enumerate(members):
        labels = member_labels(y, i, per_member)
        argument = f"`y[{i}]`" if per_member else "`y`"
        if per_member and rows is not None:
            _check_rows(labels, rows, i, member, argument)
        for name, label, output, loss in _paired_labels(labels, member, argument):
            _check_label_shape(label, output, loss, i, member, name, traced)


def _check_rows(labels: Any, rows: int, i: int, member: keras.Model, argument: str) -> None:
    for leaf in tree.flatten(labels):
        shape = _dense_shape(leaf)
        if shape and shape[0] is not None and shape[0] != rows:
            raise ValueError(
                f"Invalid labels for member {i} ({member.name}): argument {argument} has "
                f"{shape[0]} rows (shape {shape}) but `x` has {rows} samples. Pass one "
                "label row per sample for every member."
            )


def _check_label_shape(
    label: Any, output: Any, loss: Any, i: int, member: keras.Model, argument: str, traced: dict
) -> None:
    """Raises when Keras's `loss` fails on labels shaped like `label` and `output`.

    `traced` holds the outcomes of the traces made so far, by loss and shapes: members that
    share a loss configuration and shapes (a pack's usual case) are traced once.
    """
    shape = _dense_shape(label)
    reference = tuple(output.shape)
    if shape is None or not shape or any(d is None for d in shape[1:] + reference[1:]):
        return
    if not _same_rank_for_loss(shape, reference):
        # Keras's losses compare these only after broadcasting the batch's rows.
        return
    # Same number of rows in both, as in a batch.
    key = (_loss_key(loss), shape[1:], _dtype(label), reference[1:], output.dtype)
    if key not in traced or key[0] is None:
        y_true = keras.KerasTensor((2, *shape[1:]), _dtype(label))
        y_pred = keras.KerasTensor((2, *reference[1:]), output.dtype)
        traced[key] = _trace_failure(loss, y_true, y_pred)
    failure = traced[key]
    if failure is None:
        return
    if _is_sparse(loss):
        accepted = (
            f"class indices of shape {(None, *reference[1:-1])} or {(None, *reference[1:-1], 1)}"
        )
    else:
        accepted = f"labels shaped like its output, {reference}"
    raise ValueError(
        f"Invalid labels for member {i} ({member.name}): argument {argument} has shape "
        f"{shape}, which its loss `{loss.name}` cannot compare with the member's output of "
        f"shape {reference}. It accepts {accepted}. For members with different labels pass "
        "`y=[y_member0, y_member1, ...]` (one entry per member)."
    ) from failure


def _member_inputs_or_none(member: keras.Model) -> list | None:
    """A Functional or Sequential member's `keras.Input`s, or None when it has none."""
    try:
        inputs = member.inputs
    except (AttributeError, ValueError):
        return None
    return list(inputs) if inputs else None


def _paired_inputs(given: Any, inputs: list) -> list[tuple[str, Any, Any]]:
    """`(argument, array, keras.Input)` for each input of `member`; [] when unsure."""
    if len(inputs) == 1 and not isinstance(given, (dict, list, tuple)):
        return [("`x`", given, inputs[0])]
    if isinstance(given, dict):
        if not all(t.name in given for t in inputs):
            return []
        return [(f"`x[{t.name!r}]`", given[t.name], t) for t in inputs]
    if isinstance(given, (list, tuple)) and len(given) == len(inputs):
        return [(f"`x[{k}]`", leaf, t) for k, (leaf, t) in enumerate(zip(given, inputs))]
    return []


def _paired_labels(labels: Any, member: keras.Model, argument: str) -> list[tuple]:
    """`(argument, labels, output, loss)` for each output of a compiled `member` whose loss
    is one of Keras's own; [] when unsure."""
    count = output_count(member)
    if labels is None or count is None or not member.compiled:
        return []
    outputs = member.outputs
    names = list(getattr(member, "output_names", None) or [])
    if count == 1:
        if isinstance(labels, (list, tuple)) and len(labels) == 1:
            pairs = [(f"{argument}[0]", labels[0])]
        elif isinstance(labels, dict) and len(labels) == 1:
            key = next(iter(labels))
            pairs = [(f"{argument}[{key!r}]", labels[key])]
        else:
            pairs = [(argument, labels)]
    elif isinstance(labels, (list, tuple)) and len(labels) == count:
        pairs = [(f"{argument}[{j}]", label) for j, label in enumerate(labels)]
    elif isinstance(labels, dict) and len(names) == count and all(n in labels for n in names):
        pairs = [(f"{argument}[{n!r}]", labels[n]) for n in names]
    else:
        return []
    result = []
    for j, (name, label) in enumerate(pairs):
        loss = _keras_loss(_output_loss(member.loss, j, names, count))
        if loss is not None:
            result.append((name, label, outputs[j], loss))
    return result


def _output_loss(loss: Any, j: int, names: list[str], count: int) -> Any:
    """The loss a member compiled with `loss` applies to its output `j`."""
    if isinstance(loss, (list, tuple)):
        return loss[j] if len(loss) == count else None
    if isinstance(loss, dict):
        return loss.get(names[j]) if len(names) == count else None
    return loss


def _keras_loss(identifier: Any) -> keras.losses.Loss | None:
    """Keras's own loss for `identifier` as `compile` makes it, or None for other losses."""
    if identifier is None or str(identifier).lower() in ("crossentropy", "ce"):
        # `compile` picks these from the labels' shapes.
        return None
    try:
        loss = keras.losses.get(identifier)
    except (TypeError, ValueError):
        return None
    classes = _keras_loss_classes()
    if type(loss) in classes:
        return loss
    if not any(loss is fn for fn in vars(keras.losses).values()):
        return None
    # `compile` wraps Keras's loss functions as their classes do (`LossFunctionWrapper`).
    key = getattr(loss, "__name__", "").replace("_", "").lower()
    matching = [cls for cls in classes if cls.__name__.lower() == key]
    return matching[0]() if len(matching) == 1 else None


@functools.cache
def _keras_loss_classes() -> frozenset[type]:
    """Keras's own loss classes (`keras.losses.MeanSquaredError`, ...)."""
    return frozenset(
        obj
        for obj in vars(keras.losses).values()
        if isinstance(obj, type)
        and issubclass(obj, keras.losses.Loss)
        and obj is not keras.losses.Loss
    )


def _is_sparse(loss: keras.losses.Loss) -> bool:
    return isinstance(loss, keras.losses.SparseCategoricalCrossentropy)


def _same_rank_for_loss(shape: tuple, reference: tuple) -> bool:
    """Whether Keras's losses give labels of `shape` the rank of outputs of `reference`:
    equal ranks, or one more with a trailing 1 (squeezed, or expanded for rank 1)."""
    longer, shorter = sorted((shape, reference), key=len, reverse=True)
    return len(longer) == len(shorter) or (len(longer) == len(shorter) + 1 and longer[-1] == 1)


def _differs(shape: tuple, reference: tuple) -> bool:
    """Whether `shape` has another rank than `reference`, or another known size."""
    if len(shape) != len(reference):
        return True
    return any(a is not None and b is not None and a != b for a, b in zip(shape[1:], reference[1:]))


def _rows(x: Any) -> int | None:
    """The number of samples in array inputs `x`, or None when not known for certain."""
    if x is None:
        return None
    sizes = {_dense_shape(leaf) for leaf in tree.flatten(x)}
    rows = {s[0] for s in sizes if s}
    if None in sizes or len(rows) != 1:
        return None
    return rows.pop()


def _dense_shape(leaf: Any) -> tuple | None:
    """The shape of a dense array, tensor or `tf.TensorSpec`; None for anything else."""
    if not _is_dense(leaf):
        return None
    try:
        return tuple(None if d is None else int(d) for d in leaf.shape)
    except (TypeError, ValueError):
        return None


def _is_dense(leaf: Any) -> bool:
    if isinstance(leaf, np.ndarray):
        return leaf.dtype.kind in "biuf"
    tf = sys.modules.get("tensorflow")
    if tf is not None and (type(leaf) is tf.TensorSpec or isinstance(leaf, tf.Tensor)):
        return leaf.dtype.is_floating or leaf.dtype.is_integer or leaf.dtype.is_bool
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(leaf, jax.Array)


def _dtype(leaf: Any) -> str:
    dtype = leaf.dtype
    return keras.backend.standardize_dtype(getattr(dtype, "name", dtype))


def _symbolic(leaf: Any) -> Any:
    """A symbolic tensor shaped as `leaf`; `leaf` itself when it is not a dense array."""
    shape = _dense_shape(leaf)
    return leaf if shape is None else keras.KerasTensor(shape, _dtype(leaf))


def _loss_key(loss: Any) -> Any:
    """What identifies a Keras loss's computation (its class and configuration), or `None`
    for a loss whose configuration cannot be read."""
    try:
        return type(loss), repr(sorted(loss.get_config().items()))
    except Exception:  # noqa: BLE001 - such a loss is traced every time.
        return None


def _trace_failure(fn: Callable[..., Any], *args: Any) -> Exception | None:
    """The error `fn` raises on the symbolic `args`, computing shapes only; None if none."""
    try:
        _Traced(fn).compute_output_spec(*args)
    except Exception as e:  # noqa: BLE001 - any failure of the member's own code counts.
        return e
    return None


class _Traced(keras.Operation):
    """Computes `fn`'s output shapes on symbolic tensors (nothing runs, nothing is kept)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def call(self, *args: Any) -> Any:
        return self.fn(*args)
