"""Building a pack's members, and their loss and metric state, from one batch of data.

Keras builds a model from one batch in `_symbolic_build`; a pack builds each member from
its share of that batch (its inputs and labels), the members its fused layers were built
from when others were loaded by values into their slots, and the fused groups' metric
state.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import keras

from keras_gpushare import _upstream
from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack import members as members_lib
from keras_gpushare.pack._loop import _fit_args
from keras_gpushare.pack.engines.base import GradientEngine


def first_batch(models: Sequence[keras.Model], iterator: Any) -> Any:
    """The first batch of `iterator` (a Keras epoch iterator) when building `models` needs
    one (`_fit_args.needs_a_batch`), else `None`.

    Args:
        models: the pack and its members.
        iterator: the epoch iterator Keras hands `_symbolic_build`, or `None`.
    """
    if iterator is None or not _fit_args.needs_a_batch(models):
        return None
    for data_or_iterator in _upstream.epoch_iterator_data(iterator):
        if isinstance(data_or_iterator, (list, tuple)):
            return data_or_iterator[0]
        return next(data_or_iterator)
    return None


def build_from_batch(
    data_batch: Any,
    members: Sequence[keras.Model],
    gradient_engines: Sequence[GradientEngine],
    output_counts: Sequence[int | None],
    which: Container[int] | None,
    eager: Container[int],
    compiled: bool,
) -> None:
    """Builds the members `which` names (positions; `None`: all) from their shares of
    `data_batch`, and the gradient engines' metric states when the pack is compiled.

    Args:
        data_batch: one batch of the pack's data.
        members: the pack's members.
        gradient_engines: the engines whose members the pack's optimizer updates.
        output_counts: each member's number of outputs.
        which: the members to build, or `None` for all.
        eager: the members whose own optimizers are built with them.
        compiled: whether the pack is compiled (its metrics then need building).
    """
    n = len(members)
    batches = data_lib.member_batches(data_batch, members, range(n), output_counts, shard=False)
    for i, (member, batch) in enumerate(zip(members, batches)):
        if which is None or i in which:
            members_lib.build_member(member, batch, build_optimizer=i in eager)
    # A member loaded by values before the first step: its engine keeps the loss and
    # metrics of the member it was built with, which must be built too.
    for engine in gradient_engines:
        for i in engine.loaded_by_values():
            if which is None or i in which:
                original = engine.members[list(engine.member_ids).index(i)]
                members_lib.build_member(original, batches[i], build_optimizer=False)
    if compiled:
        y = keras.utils.unpack_x_y_sample_weight(data_batch)[1]
        for engine in gradient_engines:
            engine.build_metric_states(y)


def gradient_variables(
    trainable_variables: Sequence[Any],
    gradient_engines: Sequence[GradientEngine],
    loss_scale: Any,
) -> list:
    """The trainable variables the pack's optimizer updates, in Keras's order.

    The fused groups' stacked weights and the members' loss scales: Keras hands the pack's
    optimizer `trainable_variables` in this order on every backend.

    Args:
        trainable_variables: the pack's `trainable_variables`.
        gradient_engines: the engines whose members the pack's optimizer updates.
        loss_scale: the members' dynamic loss scales, or `None`.
    """
    ids = {
        id(variable)
        for engine in gradient_engines
        for layer in engine.keras_objects()
        for variable in layer.trainable_variables
    }
    if loss_scale is not None:
        ids.add(id(loss_scale))
    return [v for v in trainable_variables if id(v) in ids]


def build_optimizers(
    members: Sequence[keras.Model],
    eager: Container[int],
    optimizer: keras.optimizers.Optimizer,
    variables: Sequence[Any],
    gradient_engines: Sequence[GradientEngine],
) -> None:
    """Creates the optimizer variables of the members `eager` names, and the pack
    optimizer's.

    A member's optimizer that already holds state (the member trained before it joined the
    pack) hands that state to the pack's optimizer, so training continues from it.

    Args:
        members: the pack's members.
        eager: the members whose own optimizers are built with the pack.
        optimizer: the pack's optimizer.
        variables: the variables the pack's optimizer updates.
        gradient_engines: the engines whose members the pack's optimizer updates.
    """
    for i, member in enumerate(members):
        if i in eager and not member.optimizer.built:
            member.optimizer.build(member.trainable_variables)
    if not optimizer.built:
        optimizer.build(variables)
        for engine in gradient_engines:
            engine.read_optimizer_state(optimizer)
