"""How a pack's batch reaches its members: `replicate` (all see it) or `shard` (a slice each)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import tree

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
    return [getattr(t, "name", None) for t in inputs if getattr(t, "name", None)]


def _takes_dict(member: keras.Model) -> bool:
    return isinstance(getattr(member, "_inputs_struct", None), dict)


def shard_rows(value: Any, i: int, n: int) -> Any:
    """Rows `i, i+n, i+2n, ...` of every array in `value` (the seeds' `x[i::n]`)."""
    if value is None:
        return None
    return tree.map_structure(lambda t: t[i::n], value)


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
    return isinstance(value, (list, tuple)) and len(value) == n


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
