"""The fused engine: a group of members computed as one model with stacked weights.

The members are fused into a `FusedModel` (every weight with a leading member axis) and
updated by the pack's `VectorizedOptimizer`, both driven by Keras's own training step on
every backend. The pack's loss is the sum of the members' own compiled losses, so member
`j`'s slice of every stacked weight gets exactly member `j`'s gradient. A member that is not
active (frozen, stopped) gets a non-finite gradient on purpose: the vectorized optimizer never
applies one, so that member's weights, optimizer slots and step count stay as they are, with
no extra state that a stateless (JAX) step would have to carry.

The engine decides how its members' losses and metrics are computed and keeps their state;
the stacked computations themselves live beside it, as Keras keeps its compiled loss and
metrics apart from its trainer: the losses in `_stacked_loss`, the running means and
metrics (`StackedMean`, `StackedMetric`) in `_stacked_metric`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops, tree

from keras_gpushare import _upstream
from keras_gpushare.pack import _replicas, _slots
from keras_gpushare.pack import data as data_lib
from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack._status import ACTIVE
from keras_gpushare.pack.engines._penalties import MemberPenalties
from keras_gpushare.pack.engines._stacked_loss import (
    STACKED_OUTPUTS,
    OneLoss,
    OutputLoss,
    grouped_losses,
    loss_groups,
    output_losses,
    output_losses_stack,
    stacked_structure,
)
from keras_gpushare.pack.engines._stacked_metric import (
    StackedMean,
    StackedMetric,
    alike_columns,
    figure_name,
    initial_values,
    metrics_alike,
    own_reason,
    probe,
    ready,
    undivided,
    weighted_sums,
)
from keras_gpushare.pack.engines.base import (
    EngineOptions,
    GradientEngine,
    GroupFigures,
)
from keras_gpushare.pack.fusion import build_fused_model
from keras_gpushare.pack.fusion.model import fuse_planned, member_part, set_member_part

logger = logging.getLogger(__name__)


def _split(outputs: Any, n: int) -> list:
    """Member `j`'s outputs (slice `j` of every stacked leaf) for each member.

    One unstack per leaf rather than a slice per member and leaf: the traced step then has
    one operation where it had N (and N in its gradient).
    """
    flat = tree.flatten(outputs)
    pieces = [ops.unstack(leaf, num=n, axis=0) for leaf in flat]
    return [tree.pack_sequence_as(outputs, [p[j] for p in pieces]) for j in range(n)]


def _resolve(path: Any, value: Any) -> Any:
    for key in path:
        value = value[key]
    return value


_PER_MEMBER_LABELS = (
    "This ModelPack computes its members' losses and metrics stacked, as the labels it was "
    "first trained or evaluated with could be stacked (shared by every member, or one "
    "array per one-output member, all of one shape and dtype); now the labels differ per "
    "member in a way that cannot be stacked (members of several outputs, or labels of "
    "different shapes or dtypes). Pass labels the same way to every `fit` and `evaluate` "
    "of a pack, or build a new ModelPack for the other layout."
)


def _alike_arrays(arrays: list) -> bool:
    """Whether `arrays` are of one shape and dtype, so that they stack."""
    first = arrays[0]
    return all(
        tuple(a.shape) == tuple(first.shape)
        and keras.backend.standardize_dtype(a.dtype) == keras.backend.standardize_dtype(first.dtype)
        for a in arrays
    )


def _batch_size(x: Any) -> Any:
    return ops.shape(tree.flatten(x)[0])[0]


class FusedEngine(GradientEngine):
    """Members of one architecture as one `FusedModel`, updated by the pack's optimizer.

    Args:
        members: the member models, in `member_ids` order.
        member_ids: each member's position in the pack.
        options: the pack's `EngineOptions`.
        fusion_plan: the members' `FusionPlan`, when the planner has inspected them
            (else they are inspected here).
    """

    kind = "fused"
    default_steps_per_execution = 64

    def __init__(
        self,
        members: Sequence[keras.Model],
        member_ids: Sequence[int],
        options: EngineOptions,
        fusion_plan: Any = None,
    ) -> None:
        super().__init__(members, member_ids, options)
        # `data="shard"`: each member's rows of a training batch reach its slice of the
        # fused model, `(k, rows / N, ...)`; other batches are broadcast to every slice.
        self._shard = options.data_mode == "shard"
        input_mode = "stacked" if self._shard else "replicate"
        if fusion_plan is None:
            self.fused = build_fused_model(self.members, input_mode)
        else:
            self.fused = fuse_planned(self.members, fusion_plan, input_mode)
        # Whether the batch of the step being traced was dealt to the members (`call`).
        self._dealt = False
        self._penalties = MemberPenalties(self.fused, self.members)
        # The models whose weights each slice is: the members, or the models loaded into
        # their slots by values (`load_member`); `members` keep the losses and metrics the
        # step was traced with.
        self.views = list(self.members)
        # The last model asked about by `_by_values`, and the answer.
        self._last_by_values: tuple | None = None
        self.loss_state = StackedMean(len(self.members), name="member_loss")
        self.metric_states: dict[str, StackedMean | StackedMetric] = {}
        # Members of several outputs: each output's loss tracker (`a_loss`), stacked, by
        # figure name, once their losses are computed stacked (`_losses_stacked`).
        self.tracker_states: dict[str, StackedMean] = {}
        # Each member's own name of each stacked loss tracker (`{output}_loss`: members'
        # outputs may be named differently), by member 0's.
        self._tracker_names: dict[str, list[str]] = {}
        self._loss_groups: list[OneLoss] | None = None
        self._several_outputs_stack = False
        self._output_parts: list[OutputLoss] | None = None
        self._losses_stacked = False
        # Whether the members' compiled metrics are computed column by column
        # (`_shared_metric_columns`): stacked where they can be (`metric_states`), the
        # others member by member (`_own_columns`, figure name and the members' metrics).
        # The members' other metric variables then stay out of the step (on JAX each would
        # be two buffers a call, in and out).
        self._metrics_stacked = False
        self._own_columns: list[tuple[str, list]] = []
        # Whether the step's losses and metrics are decided (`build_metric_states`).
        self._step_planned = False

    def keras_objects(self) -> list:
        return [self.fused]

    @property
    def metrics(self) -> list:
        result = [self.loss_state, *self.metric_states.values(), *self.tracker_states.values()]
        for member in self.members:
            compiled_metrics = _upstream.compile_metrics(member)
            if compiled_metrics is not None and not self._metrics_stacked:
                result.append(compiled_metrics)
            compiled_loss = _upstream.compile_loss(member)
            if compiled_loss is not None and not self._losses_stacked:
                result.extend(compiled_loss.metrics)
        for _, column in self._own_columns:
            result.extend(column)
        return result

    def configure(self, compile_args: Sequence[dict]) -> None:
        self._loss_groups = loss_groups(self.members, compile_args)
        self._several_outputs_stack = self._loss_groups is None and output_losses_stack(
            self.members, compile_args
        )

    def supports_jit(self) -> bool:
        """Keras's rule for the fused model, except on torch and on a TensorFlow CPU.

        On a TensorFlow CPU, XLA pays unless a fused layer says it does not
        (`FusedLayer.xla_pays_on_cpu`: convolutions and pooling, where XLA's CPU backend
        is no faster than TensorFlow's own kernels and its compile time is lost; measured
        on a 16-member small CNN: same steady throughput, 1.5x slower end to end).
        """
        if not BACKEND.jit or not _upstream.model_supports_jit(self.fused):
            return False
        if BACKEND.xla_optional and not BACKEND.tensorflow_gpu():
            return self.fused.xla_pays_on_cpu
        return True

    def describe(self, index: int) -> str:
        return f"fused group {index} ({len(self.member_ids)})"

    # Forward ---------------------------------------------------------------------------

    def call(self, inputs: Any, training: bool | None = None, active: Any = None) -> Any:
        """The group's raw outputs; `active` (k,) keeps inactive members' layer state.

        A member that does not train (stopped, frozen) keeps its slice of the state a
        training call updates (BatchNormalization's moving statistics).
        """
        kept = []
        if training and active is not None:
            for layer in self.fused.graph.layers:
                for name in getattr(layer, "member_state", ()):
                    variable = getattr(layer, name)
                    # A copy: on TensorFlow a variable converts to a handle read later.
                    kept.append((variable, ops.copy(variable)))
        if self._shard:
            self._dealt = bool(training)
            inputs = self._own_rows(inputs) if training else self._broadcast(inputs)
        outputs = self.fused(inputs, training=training)
        for variable, before in kept:
            keep = ops.reshape(active, (len(self.members),) + (1,) * (len(before.shape) - 1))
            variable.assign(ops.where(keep, ops.convert_to_tensor(variable), before))
        if training and self._loss_groups is not None:
            # One output, one loss: the training step reads the stacked output directly;
            # N slices stacked back together would cost N full-size gradient terms.
            return tree.flatten(outputs)[0]
        if training and self._losses_stacked:
            return {STACKED_OUTPUTS: outputs}
        return _split(outputs, len(self.members))

    def _own_rows(self, value: Any) -> Any:
        """Each of this group's members' rows of a `data="shard"` training batch (rows
        `i, i+N, ...` for member i of the pack's N), stacked `(k, rows / N, ...)`."""
        n = len(self.options.output_counts)
        for leaf in tree.flatten(value):
            rows = leaf.shape[0]
            if rows is not None and rows % n:
                raise data_lib.uneven_shard_error(f"a batch of {rows} rows", n)
        stacked = data_lib.dealt(value, n)
        if list(self.member_ids) == list(range(n)):
            return stacked
        ids = ops.convert_to_tensor(np.asarray(self.member_ids, "int32"))
        return tree.map_structure(lambda t: ops.take(t, ids, axis=0), stacked)

    def _broadcast(self, value: Any) -> Any:
        """A batch every member takes whole (evaluation, prediction), `(k, B, ...)`."""
        k = len(self.members)
        return tree.map_structure(
            lambda t: ops.broadcast_to(ops.expand_dims(t, 0), (k, *ops.shape(t))), value
        )

    def _dealt_targets(self, y: Any, sample_weight: Any) -> tuple[Any, Any]:
        """The labels and sample weights as the members take them: `RowShards` where the
        step's batch was dealt to the members (`data="shard"` training), else as given."""
        if not self._dealt:
            return y, sample_weight
        n = len(self.options.output_counts)
        weights = None if sample_weight is None else data_lib.RowShards(sample_weight, n)
        return data_lib.RowShards(y, n), weights

    def member_outputs(self, raw: Any) -> list:
        if isinstance(raw, dict) and STACKED_OUTPUTS in raw:
            return _split(raw[STACKED_OUTPUTS], len(self.members))
        return raw if isinstance(raw, list) else _split(raw, len(self.members))

    # Loss and metrics --------------------------------------------------------------------

    def _targets(self, y: Any, sample_weight: Any) -> list:
        targets = data_lib.member_targets(y, sample_weight, self.options.output_counts)
        return [targets[i] for i in self.member_ids]

    def _labels_shared(self, y: Any) -> bool:
        return not data_lib.labels_per_member(y, self.options.output_counts)

    def _labels_stack(self, y: Any, sample_weight: Any = None) -> bool:
        """Whether labels given one per member stack for this group's members: each of one
        output, its labels (and sample weights, all or none given) one array, all of one
        shape and dtype."""
        if any(self.options.output_counts[i] != 1 for i in self.member_ids):
            return False
        if isinstance(y, data_lib.RowShards):  # one batch's rows: alike by construction
            return len(tree.flatten(y.value)) == 1 and (
                sample_weight is None or not tree.is_nested(sample_weight.value)
            )
        targets = self._targets(y, sample_weight)
        labels = [tree.flatten(yj) for yj, _ in targets]
        if any(len(leaves) != 1 for leaves in labels) or not _alike_arrays(
            [leaves[0] for leaves in labels]
        ):
            return False
        weights = [swj for _, swj in targets]
        if all(w is None for w in weights):
            return True
        if any(w is None or tree.is_nested(w) for w in weights):
            return False
        return _alike_arrays(weights)

    def _stacked_targets(self, y: Any, sample_weight: Any) -> tuple[Any, Any]:
        """Labels given one per member (`_labels_stack`), and their sample weights,
        stacked `(k, B, ...)` for this group's members."""
        if isinstance(y, data_lib.RowShards):
            labels = self._own_rows(tree.flatten(y.value)[0])
            if sample_weight is None:
                return labels, None
            return labels, self._own_rows(sample_weight.value)
        targets = self._targets(y, sample_weight)
        labels = ops.stack([tree.flatten(yj)[0] for yj, _ in targets])
        if targets[0][1] is None:
            return labels, None
        return labels, ops.stack([swj for _, swj in targets])

    def _member_losses(self, y: Any, y_pred: Any, sample_weight: Any) -> Any:
        """Every member's loss on this replica's batch, shape (k,), not scaled for replicas."""
        shared = self._labels_shared(y)
        groups = self._loss_groups
        if shared:
            stack = sample_weight is None or not tree.is_nested(sample_weight)
        else:
            stack = self._labels_stack(y, sample_weight)
        if stack and groups is not None and all(group.stacked for group in groups):
            labels, weights = y, sample_weight
            if not shared:
                labels, weights = self._stacked_targets(y, sample_weight)
            try:
                return grouped_losses(groups, labels, y_pred, weights, not shared)
            except Exception as e:  # a loss this backend cannot vectorize
                if not any(group.mapped for group in groups):
                    raise
                logger.debug("The members' loss is computed member by member: %s", e)
                for group in groups:
                    group.stacked = not group.mapped
        if self._losses_stacked:
            if not shared:
                raise ValueError(_PER_MEMBER_LABELS)
            return self._stacked_output_losses(y, y_pred, sample_weight)
        y_pred = self.member_outputs(y_pred)
        losses = []
        for j, (member, (yj, swj)) in enumerate(zip(self.members, self._targets(y, sample_weight))):
            value = _upstream.compile_loss(member)(yj, y_pred[j], swj)
            losses.append(ops.cast(_upstream.unscale_loss_for_distribution(value), "float32"))
        return ops.stack(losses)

    def _stacked_output_losses(self, y: Any, y_pred: Any, sample_weight: Any) -> Any:
        """Every member's loss, shape (k,), output by output on the stacked outputs, as
        Keras's `CompileLoss` computes one member's: each output's loss (a call per distinct
        loss on its members' rows; its tracker updated, unweighted), times each member's
        loss weight, summed."""
        outputs = stacked_structure(y_pred)
        labels = self._labels_like(y, outputs)
        batch = ops.cast(_batch_size(y), "float32")
        total = None
        for part in self._output_parts or ():
            weights = sample_weight
            if sample_weight is not None and tree.is_nested(sample_weight):
                weights = _resolve(part.path, sample_weight)
            label, output = _resolve(part.path, labels), _resolve(part.path, outputs)
            values = grouped_losses(part.groups, label, output, weights, False)
            if part.tracker is not None:
                self.tracker_states[part.tracker].update_state(
                    values, ops.ones_like(values) * batch
                )
            if part.weights is not None:
                values = values * ops.convert_to_tensor(part.weights)
            total = values if total is None else total + values
        return total

    def _labels_like(self, y: Any, outputs: Any) -> Any:
        """The shared labels `y` in the structure of the members' outputs (a list or tuple
        of one label per output, or a dict by output name, as Keras takes them)."""
        if isinstance(y, dict) and not isinstance(outputs, dict):
            return [y[name] for name in self.members[0].output_names]
        return tree.pack_sequence_as(outputs, tree.flatten(y))

    def _stackable_loss_parts(self) -> bool:
        """Whether the members' built compiled losses compute as `_stacked_output_losses`
        does (`output_losses`); keeps their parts output by output if so."""
        compiled = [_upstream.compile_loss(m) for m in self.members]
        if not self._several_outputs_stack or any(c is None or not c.built for c in compiled):
            return False
        self._output_parts = output_losses([_upstream.loss_parts(c) for c in compiled])
        return self._output_parts is not None

    def loss(
        self, x: Any, y: Any, y_pred: Any, sample_weight: Any, status: Any, training: bool
    ) -> tuple[Any, Any]:
        """This group's member losses to sum, and which members to freeze.

        Every member's loss goes into the group's stacked loss state. In training, a member
        that is not active gets a NaN factor on its loss, hence a non-finite gradient that
        the vectorized optimizer never applies, and a member whose loss is not finite (on
        any replica, under a `tf.distribute` strategy) is to be frozen.

        Returns:
            `(losses, freeze)`: the (k,) losses whose sum the pack differentiates, and a
            boolean (k,) vector (all false outside training or with `on_nan="ignore"`).
        """
        batch = ops.cast(_batch_size(x), "float32")
        if self._dealt:
            batch = batch / len(self.options.output_counts)
        y, sample_weight = self._dealt_targets(y, sample_weight)
        losses = self._member_losses(y, y_pred, sample_weight)
        if self._penalties:
            losses = losses + self._penalties()
        if not training:
            self.loss_state.update_state(losses, ops.ones_like(losses) * batch)
            return losses, ops.zeros(losses.shape, dtype="bool")
        active = ops.equal(status, ACTIVE)
        finite = ops.isfinite(losses)
        # A non-finite loss enters the member's mean as in Keras, unless it freezes the member.
        ok = ops.logical_and(active, finite) if self.options.on_nan == "freeze" else active
        self.loss_state.update_state(
            ops.where(ok, losses, 0.0), ops.where(ok, batch, 0.0) * ops.ones_like(losses)
        )
        freeze = ops.zeros(losses.shape, dtype="bool")
        if self.options.on_nan == "freeze":
            freeze = ops.logical_and(active, _replicas.any_replica(ops.logical_not(finite)))
        return losses * ops.where(active, 1.0, float("nan")), freeze

    def read_optimizer_state(self, optimizer: Any) -> None:
        optimizer.read_state_from(
            [m.optimizer for m in self.members],
            self.fused.member_variable_map(self.members),
            self.member_ids,
        )

    def learning_rate_handle(self, j: int, optimizer: Any) -> Any:
        return optimizer.optimizers[self.member_ids[j]]

    def occupant(self, j: int) -> keras.Model:
        return self.views[j]

    def loaded_by_values(self) -> list[int]:
        return [i for i, v, m in zip(self.member_ids, self.views, self.members) if v is not m]

    def load_problem(self, j: int, model: keras.Model, optimizer: Any) -> str | None:
        """As for every engine, unless the fused layers hold their settings as data: then
        `model` may also differ from the member in what the slot holds (widths up to the
        fused layers', activations among theirs, dropout rates), and, when the vectorized
        optimizer holds them too, in its optimizer's family and hyperparameters."""
        why = self._by_values(model)[1]
        if why is not None:
            exact = super().load_problem(j, model, optimizer)
            return exact if exact is None or not self.fused.holds_slots else why
        if optimizer.settings.held:
            optimizer_problem = optimizer.load_problem(self.member_ids[j], model.optimizer)
        else:
            optimizer_problem = _slots.optimizer_difference(
                self.members[j].optimizer, model.optimizer
            )
        return _slots.compile_difference(self.members[j], model) or optimizer_problem

    def _by_values(self, model: keras.Model) -> tuple[list, str | None]:
        """`model`'s layers paired with the fused ones when it loads by values, or why not
        (the same for every slot: the last model's answer is kept)."""
        if not self.fused.holds_slots:
            return [], "the fused layers hold their settings as constants"
        last = self._last_by_values
        if last is None or last[0] is not model:
            self._last_by_values = last = (model, self.fused.slot_layers(model))
        return last[1]

    def load_member(self, j: int, model: keras.Model, optimizer: Any) -> None:
        """Member j's slices of the stacked weights take `model`'s (and, when the fused
        layers hold them, its settings: `model` then is member j's view); the vectorized
        optimizer gives it `model`'s learning rate and a fresh state."""
        pairs, why = self._by_values(model)
        if why is None:
            self.fused.load_member(j, pairs)
            self.views[j] = model
        else:
            self.set_member_weights(j, model.get_weights())
        optimizer.load_member(self.member_ids[j], model.optimizer)
        self._reset_metrics(j)

    def reset_member(self, j: int, optimizer: Any) -> None:
        """Member j's rows of the vectorized optimizer's state restart; its metrics zeroed."""
        optimizer.reset_member(self.member_ids[j])
        self._reset_metrics(j)

    def _reset_metrics(self, j: int) -> None:
        """Zeroes member j's row of the stacked loss and metrics, and its own metrics."""
        for state in (self.loss_state, *self.metric_states.values(), *self.tracker_states.values()):
            state.reset_member(j)
        member = self.members[j]
        compiled_metrics = _upstream.compile_metrics(member)
        if compiled_metrics is not None:
            compiled_metrics.reset_state()
        compiled_loss = _upstream.compile_loss(member)
        if compiled_loss is not None:
            for tracker in compiled_loss.metrics:
                tracker.reset_state()

    def update_metrics(self, y: Any, y_pred: Any, sample_weight: Any) -> None:
        """Updates every member's compiled metrics.

        With labels that stack (shared, or one array per one-output member, all of one
        shape) and metrics of the same names output by output, each metric
        that every member has alike is computed for all members at once on the stacked
        predictions into stacked state (`metrics=` ignore sample weights,
        `weighted_metrics=` take them, as in Keras): means of a function (accuracy, MAE,
        top-k, ...) and the `StackedMetric` kinds (AUC, precision, F1, R2, IoU, ..., and a
        user's metric class its trial found to map, `_stacked_metric.probe`). Each
        other metric is computed member by member, the others' still stacked; members
        whose metrics differ in names are computed member by member altogether.
        """
        y, sample_weight = self._dealt_targets(y, sample_weight)
        targets = self._targets(y, sample_weight)
        compiled_metrics = [_upstream.compile_metrics(member) for member in self.members]
        member_preds = None
        if any(c is not None and not c.built for c in compiled_metrics):
            member_preds = self.member_outputs(y_pred)
            for compiled, (yj, _), pred in zip(compiled_metrics, targets, member_preds):
                if compiled is not None and not compiled.built:
                    compiled.build(yj, pred)
        # Stacked only as decided before the first step (`build_metric_states`): a step
        # that made the stacked state as it ran would change the state it carries.
        columns = self._shared_metric_columns(y) if self._metrics_stacked else None
        if columns is not None:
            self._update_shared_metrics(columns, y, y_pred, sample_weight, compiled_metrics)
            return
        if self._metrics_stacked:
            raise ValueError(_PER_MEMBER_LABELS)
        if member_preds is None:
            member_preds = self.member_outputs(y_pred)
        for compiled, (yj, swj), pred in zip(compiled_metrics, targets, member_preds):
            if compiled is not None:
                compiled.update_state(yj, pred, swj)

    def _shared_metric_columns(self, y: Any) -> list | None:
        """Per metric, `(output, figure name, the members' metric objects, weighted,
        stacked)` when every member's compiled metrics can be computed column by column:
        metrics and weighted metrics of the same names, output by output (`alike_columns`);
        figures named as Keras's `CompileMetrics.result` names them."""
        if not self._labels_shared(y) and not self._labels_stack(y):
            return None
        compiled = [_upstream.compile_metrics(m) for m in self.members]
        if any(c is None for c in compiled):
            return None if any(c is not None for c in compiled) else []
        if not all(c.built for c in compiled):
            return None
        columns: list = []
        names: dict[str, int] = {}
        for weighted in (False, True):
            found = alike_columns([_upstream.metric_parts(c, weighted) for c in compiled])
            if found is None:
                return None
            for output, output_name, metric, column, stacked in found:
                figure = figure_name(names, output_name, metric.name, weighted)
                columns.append((output, figure, column, weighted, stacked))
        return columns

    def _update_shared_metrics(
        self, columns: list, y: Any, y_pred: Any, sample_weight: Any, compiled_metrics: list
    ) -> None:
        if not columns:
            return
        compiled = compiled_metrics[0]
        predictions = _upstream.flat_outputs(compiled, stacked_structure(y_pred))
        per_member = not self._labels_shared(y)
        if per_member:
            if not self._labels_stack(y, sample_weight):
                raise ValueError(_PER_MEMBER_LABELS)
            label, weight = self._stacked_targets(y, sample_weight)
            labels, weights = [label], [weight]
        else:
            labels = _upstream.flat_outputs(compiled, y)
            weights = [None] * len(labels)
            if sample_weight is not None:
                weights = _upstream.flat_outputs(compiled, sample_weight)
                if len(weights) < len(labels):  # one weight every output, as Keras repeats it
                    weights = [weights[0]] * len(labels)
        member_preds = None
        for output, figure, column, weighted, together in columns:
            first, stacked, label = column[0], predictions[output], labels[output]
            weight = weights[output] if weighted else None
            if not together:  # as Keras's `CompileMetrics.update_state`, member by member
                if member_preds is None:
                    member_preds = [
                        _upstream.flat_outputs(c, p)
                        for c, p in zip(compiled_metrics, self.member_outputs(y_pred))
                    ]
                for j, (metric, preds) in enumerate(zip(column, member_preds)):
                    own_label = label[j] if per_member else label
                    if weighted:
                        own_weight = weight[j] if per_member and weight is not None else weight
                        metric.update_state(own_label, preds[output], own_weight)
                    else:
                        metric.update_state(own_label, preds[output])
                continue
            state = self._metric_state(first, figure)
            if isinstance(state, StackedMetric):
                state.update_state(label, stacked, weight, per_member=per_member)
                continue
            fn, fn_kwargs = _upstream.wrapped_metric_function(first)
            if not per_member:
                label = ops.broadcast_to(
                    ops.expand_dims(label, 0), (stacked.shape[0], *ops.shape(label))
                )
            values = ops.cast(fn(label, stacked, **fn_kwargs), "float32")
            if weight is None:
                axes = tuple(range(1, len(values.shape)))
                count = ops.cast(ops.prod(ops.shape(values)[1:]), "float32")
                state.update_state(
                    ops.sum(values, axis=axes) / count, ops.ones((len(column),)) * count
                )
            else:
                state.add(*weighted_sums(values, weight, per_member))

    def _metric_state(
        self, metric: keras.metrics.Metric, figure: str
    ) -> StackedMean | StackedMetric:
        """The stacked state of the shared metric `metric` (member 0's) logged as `figure`,
        made on first use."""
        state = self.metric_states.get(figure)
        if state is None:
            if isinstance(metric, keras.metrics.MeanMetricWrapper):
                state = StackedMean(len(self.members), name=f"member_{figure}")
            else:
                state = StackedMetric(metric, len(self.members), initial_values(metric))
            self.metric_states[figure] = state
        return state

    def build_metric_states(self, y: Any) -> None:
        """Makes the shared metrics' and loss trackers' stacked state before the first step.

        Without a strategy the first trace of the step may make it; under a `tf.distribute`
        strategy variables must exist before the step runs on the replicas.
        """
        self._step_planned = True
        self._ready_metrics()
        self._probe_user_metrics(y)
        columns = self._shared_metric_columns(y)
        for _, figure, column, _, stacked in columns or []:
            if stacked:
                self._metric_state(column[0], figure)
        # Once stacked, always: the figures are read from the stacked state from then on.
        if y is not None and columns and not self._metrics_stacked:
            self._metrics_stacked = True
            self._own_columns = [(f, column) for _, f, column, _, stacked in columns if not stacked]
        # (`data="shard"`: a training batch's labels are the members' own, which the
        # output-by-output losses do not take.)
        if y is None or self._shard or not self._labels_shared(y):
            return
        if not self._stackable_loss_parts():
            return
        parts = [_upstream.loss_parts(_upstream.compile_loss(m)) for m in self.members]
        for k, (*_, tracker) in enumerate(parts[0]):
            if tracker is not None and tracker.name not in self.tracker_states:
                state = StackedMean(len(self.members), name=f"member_{tracker.name}")
                self.tracker_states[tracker.name] = state
                self._tracker_names[tracker.name] = [own[k][3].name for own in parts]
        self._losses_stacked = True

    def _probe_user_metrics(self, y: Any) -> None:
        """Tries each column of a user's metric classes stacked on this batch's labels
        (`_stacked_metric.probe`): the columns it maps exactly are then computed stacked."""
        if y is None or not self._labels_shared(y) and not self._labels_stack(y):
            return
        compiled = [_upstream.compile_metrics(m) for m in self.members]
        outputs = getattr(self.members[0], "outputs", None)
        if not outputs or any(c is None or not c.built for c in compiled):
            return
        per_member = not self._labels_shared(y)
        if per_member:  # one member's, for their shape and dtype
            labels = tree.flatten(self._targets(y, None)[0][0])
        else:
            labels = _upstream.flat_outputs(compiled[0], y)
        shapes = [tuple(t.shape) for t in tree.flatten(outputs)]
        for weighted in (False, True):
            found = alike_columns([_upstream.metric_parts(c, weighted) for c in compiled])
            for output, _, metric, column, stacked in found or []:
                if stacked or isinstance(metric, keras.metrics.MeanMetricWrapper):
                    continue
                if not metrics_alike(column) or output >= len(shapes):
                    continue
                probe(column, labels[output], shapes[output], per_member, weighted)

    def _ready_metrics(self) -> None:
        """Makes the state of member 0's metrics that make it on their first update (their
        stacked state is shaped after it), for predictions of its outputs' shapes."""
        compiled = _upstream.compile_metrics(self.members[0])
        outputs = getattr(self.members[0], "outputs", None)
        if compiled is None or not compiled.built or not outputs:
            return
        shapes = [tuple(t.shape) for t in tree.flatten(outputs)]
        for weighted in (False, True):
            parts = _upstream.metric_parts(compiled, weighted)
            if len(parts) != len(shapes):
                return
            for part, shape in zip(parts, shapes):
                for metric in part[1] if part is not None else ():
                    ready(metric, shape)

    def step_notes(self) -> list[str]:
        """What of the members' losses and metrics the step computes member by member, and
        why (`ModelPack.fusion_report`); empty when everything is stacked or before the
        pack first trains or evaluates."""
        notes: list[str] = []
        if not self._step_planned:
            return notes
        groups = self._loss_groups
        if groups is not None and not all(group.stacked for group in groups):
            notes.append("loss computed member by member: this backend could not vectorize it")
        elif groups is None and not self._losses_stacked:
            notes.append(
                "loss computed member by member: the members have several outputs and a "
                "user's loss, or a loss of reduction None, or labels given per member that "
                "do not stack (several outputs, shapes that differ)"
            )
        if self._own_columns:
            own = "; ".join(
                f"{figure} ({own_reason(column)})" for figure, column in self._own_columns
            )
            notes.append(f"metrics computed member by member: {own}")
        elif not self._metrics_stacked and any(
            _upstream.compile_metrics(m) is not None for m in self.members
        ):
            notes.append(
                "metrics computed member by member: the members' metrics differ in names, "
                "or labels given per member do not stack (several outputs, shapes that differ)"
            )
        return notes

    def figures(self) -> GroupFigures:
        """The stacked loss and shared metrics as they are (running means undivided);
        other metrics member by member."""
        shared = {name: undivided(state) for name, state in self.metric_states.items()}
        own: list[dict] = []
        for member in self.members:
            items = {}
            compiled_metrics = _upstream.compile_metrics(member)
            if not self._metrics_stacked and compiled_metrics is not None:
                items = dict(compiled_metrics.result())
            compiled_loss = _upstream.compile_loss(member)
            if compiled_loss is not None and not self.tracker_states:
                for tracker in compiled_loss.metrics:
                    items[tracker.name] = tracker.result()
            own.append(items)
        for figure, column in self._own_columns:
            for items, metric in zip(own, column):
                items[figure] = metric.result()
        for name, state in self.tracker_states.items():
            names = self._tracker_names[name]
            if all(own_name == name for own_name in names):
                shared[name] = state.ratio()
                continue
            # Members whose outputs are named differently: each logs its own name.
            values = ops.unstack(state.result(), num=len(self.members))
            for items, own_name, value in zip(own, names, values):
                items[own_name] = value
        return GroupFigures(self.loss_state.ratio(), None, shared, own)

    # Members -----------------------------------------------------------------------------

    def sync_members(self, optimizer: Any = None) -> None:
        self.fused.write_to_members(self.views)
        if optimizer is None or not optimizer.built:
            return
        for member in self.views:
            if member.optimizer is not None and not member.optimizer.built:
                member.optimizer.build(member.trainable_variables)
        optimizer.write_state_to(
            [m.optimizer for m in self.views],
            self.fused.member_variable_map(self.views),
            self.member_ids,
        )

    def get_member_weights(self, j: int) -> list:
        member = self.views[j]
        where = {}
        for fused_variable, parts in self.fused.member_variable_map(self.views):
            variable, index = parts[j]
            if variable is not None:
                where[id(variable)] = (fused_variable, index)
        result = []
        for variable in member.weights:
            fused_variable, index = where[id(variable)]
            result.append(member_part(ops.convert_to_numpy(fused_variable), j, index))
        return result

    def set_member_weights(self, j: int, weights: list) -> None:
        member = self.views[j]
        member.set_weights(weights)
        for fused_variable, parts in self.fused.member_variable_map(self.views):
            variable, index = parts[j]
            if variable is None:
                continue
            value = np.array(ops.convert_to_numpy(fused_variable))
            set_member_part(value, j, index, ops.convert_to_numpy(variable))
            fused_variable.assign(value)
