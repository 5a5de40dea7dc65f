"""A fused step whose size does not grow with the member count.

Backend-neutral (make test runs it on TensorFlow, JAX and torch). Two kinds of tests:

- differential: the figures computed stacked (the confusion-matrix metrics, the logs) equal
  each member's own `fit` and `evaluate`;
- counts: the compiled step of N=256 members holds about as many XLA fusions (JAX, and
  TensorFlow with `jit_compile=True`) and TensorFlow graph operations as the step of one
  member. A single operation per member would add 256.
"""

import keras
import numpy as np
import pytest
from pack_builders import copy_model, mlp
from step_counts import CONFIGS, HitRate, fit_one_batch, smooth_error, step_counts

import keras_gpushare as kg

BACKEND = keras.backend.backend()


def _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone, twin=None):
    """Member i's logs and `evaluate` figures (and, given its `twin`, its weights) equal
    its own plain fit's."""
    for name in own.history:
        np.testing.assert_allclose(
            history.history[f"m{i}_{name}"], own.history[name], rtol=1e-5, atol=1e-6
        )
    for name in alone:
        np.testing.assert_allclose(evaluated[f"m{i}_{name}"], alone[name], rtol=1e-5, atol=1e-6)
    if twin is not None:
        for mine, theirs in zip(pack.member(i).get_weights(), twin.get_weights()):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def _metrics():
    # Named: Keras numbers unnamed metrics per process (auc_3), and the test compares keys.
    return [
        "accuracy",
        keras.metrics.AUC(name="auc"),
        keras.metrics.Precision(name="precision"),
        keras.metrics.Recall(thresholds=0.3, name="recall"),
        keras.metrics.TruePositives(name="true_positives"),
    ]


def test_confusion_metrics_in_the_stacked_step_equal_each_members_own_fit(binary_data):
    x, y = binary_data
    sample_weight = np.random.default_rng(1).random(len(x)).astype("float32")
    members = [mlp(w, seed=s) for s, w in enumerate((4, 7, 12))]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss="binary_crossentropy", metrics=_metrics())
    history = pack.fit(
        x, y, sample_weight=sample_weight, batch_size=32, epochs=2, shuffle=False, verbose=0
    )
    assert pack.engine == "fused"
    evaluated = pack.evaluate(x, y, return_dict=True, verbose=0)
    names = ["loss", "accuracy", "auc", "precision", "recall", "true_positives"]
    for i, twin in enumerate(twins):
        twin.compile(optimizer="adam", loss="binary_crossentropy", metrics=_metrics())
        own = twin.fit(
            x, y, sample_weight=sample_weight, batch_size=32, epochs=2, shuffle=False, verbose=0
        )
        alone = twin.evaluate(x, y, return_dict=True, verbose=0)
        for name in names:
            np.testing.assert_allclose(
                history.history[f"m{i}_{name}"], own.history[name], rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(evaluated[f"m{i}_{name}"], alone[name], rtol=1e-5, atol=1e-5)


def test_a_refilled_slot_restarts_only_its_own_stacked_metric_state(binary_data):
    x, y = binary_data
    members = [mlp(6, seed=s) for s in range(3)]
    newcomer = mlp(6, seed=7)
    twin = copy_model(newcomer)
    pack = kg.ModelPack(members)
    pack.compile(
        optimizer="adam", loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")]
    )
    pack.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    before = pack.evaluate(x, y, return_dict=True, verbose=0)
    newcomer.compile(
        optimizer="adam", loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")]
    )
    pack.load_member(1, newcomer)
    after = pack.evaluate(x, y, return_dict=True, verbose=0)
    twin.compile(
        optimizer="adam", loss="binary_crossentropy", metrics=[keras.metrics.AUC(name="auc")]
    )
    alone = twin.evaluate(x, y, return_dict=True, verbose=0)
    np.testing.assert_allclose(after["m1_auc"], alone["auc"], rtol=1e-5)
    for i in (0, 2):
        np.testing.assert_allclose(after[f"m{i}_auc"], before[f"m{i}_auc"], rtol=1e-6)


def test_the_steps_metric_state_does_not_grow_with_the_member_count(binary_data):
    x, y = binary_data
    sizes = []
    for n in (2, 8):
        pack = kg.ModelPack([mlp(4 + i, seed=i) for i in range(n)])
        pack.compile(optimizer="adam", loss="binary_crossentropy", metrics=_metrics())
        pack.fit(x, y, batch_size=32, epochs=1, verbose=0)
        sizes.append(len(pack.metrics_variables))
    assert sizes[0] == sizes[1]


class _MeanError(keras.metrics.Metric):
    """A user's stateful metric of the labels: computed member by member, each from its
    member's own labels."""

    def __init__(self, name="mean_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        error = keras.ops.abs(keras.ops.cast(y_true, "float32") - y_pred)
        self.total.assign_add(keras.ops.sum(error))
        self.count.assign_add(keras.ops.cast(keras.ops.size(error), "float32"))

    def result(self):
        return self.total / keras.ops.maximum(self.count, 1.0)


def _per_member_compile(loss):
    return {
        "optimizer": "adam",
        "loss": loss,
        "metrics": ["accuracy", keras.metrics.AUC(name="auc"), _MeanError()],
        "weighted_metrics": ["mse"],
    }


def _per_batch_error(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_labels_per_member_train_stacked_as_each_ones_own_fit(binary_data):
    """Labels (and sample weights) given one per member, `y=[y0, y1, ...]`, are stacked:
    the losses (Keras's own and a user's per-batch one, a call per loss), mean and AUC
    metrics and weighted metrics are computed on each member's own labels, and a user's
    metric member by member; after shared labels, per-member labels are taken too. Logs,
    `evaluate` and weights equal each member's own fit on its own labels."""
    x, y = binary_data
    rng = np.random.default_rng(6)
    labels = [y, 1.0 - y, (x[:, 3:4] > 0).astype("float32")]
    weights = [rng.random(len(x)).astype("float32") for _ in labels]
    losses = ["binary_crossentropy", _per_batch_error, "binary_crossentropy"]
    members = [mlp(4 + 2 * s, seed=s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(**_per_member_compile(losses))
    kwargs = dict(batch_size=32, shuffle=False, verbose=0)
    history = pack.fit(x, labels, sample_weight=weights, epochs=2, **kwargs)
    evaluated = pack.evaluate(x, labels, return_dict=True, verbose=0)
    assert pack.engine == "fused"
    assert "step: loss" not in pack.fusion_report
    assert "mean_error (" in pack.fusion_report  # the user's metric, and only it
    assert "accuracy (" not in pack.fusion_report and "auc (" not in pack.fusion_report
    shared = kg.ModelPack([copy_model(m) for m in twins])
    shared.compile(**_per_member_compile(losses))
    shared.fit(x, y, epochs=1, **kwargs)
    shared_then_own = shared.evaluate(x, labels, return_dict=True, verbose=0)
    for i, (twin, loss) in enumerate(zip(twins, losses)):
        after_shared = copy_model(twin)
        twin.compile(**_per_member_compile(loss))
        own = twin.fit(x, labels[i], sample_weight=weights[i], epochs=2, **kwargs)
        alone = twin.evaluate(x, labels[i], return_dict=True, verbose=0)
        _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone, twin)
        after_shared.compile(**_per_member_compile(loss))
        after_shared.fit(x, y, epochs=1, **kwargs)
        plain = after_shared.evaluate(x, labels[i], return_dict=True, verbose=0)
        for name in plain:
            np.testing.assert_allclose(shared_then_own[f"m{i}_{name}"], plain[name], rtol=1e-5)


def test_labels_per_member_that_cannot_stack_after_stacked_ones_are_refused_by_name(
    binary_data,
):
    """Members of two outputs whose first `fit` had shared labels compute their losses
    stacked output by output; labels given one per member later are refused, naming the
    way out."""
    x, y = binary_data
    y_b = np.stack([x[:, 0], x[:, 1]], axis=1).astype("float32")
    pack = kg.ModelPack([_two_outputs(0), _two_outputs(1)])
    pack.compile(**_two_output_compile())
    pack.fit(x, [y, y_b], batch_size=32, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="labels the same way"):
        pack.evaluate(x, [[y, y_b], [1.0 - y, y_b]], verbose=0)


COUNTED = pytest.mark.skipif(BACKEND == "torch", reason="torch has no compiled step to count")


def _flat(small: int, large: int) -> bool:
    """Within 20% plus a constant: XLA's fusion choices move a little with array sizes; an
    operation per member would add 256."""
    return large <= 1.2 * small + 32


# The configurations counted at 256 members (each fit there, and at a few, trains fused).
COUNTED_CONFIGS = [
    "binary",
    "sparse",
    "categorical",
    "regression",
    "two_outputs",
    "user_loss",
    "weighted",
]


@COUNTED
@pytest.mark.parametrize("config", COUNTED_CONFIGS)
def test_the_compiled_step_does_not_grow_with_the_member_count(config):
    # Members of different losses: a call per loss, so from two members of each (with one
    # each, XLA folds the gathers of single rows away and counts fewer than at any larger N).
    cycle = CONFIGS[config].get("loss_cycle")
    few = 2 * len(cycle) if cycle else 1
    one, many = step_counts(config, few), step_counts(config, 256)
    assert set(one) == set(many) and one
    for what in one:
        assert _flat(one[what], many[what]), (config, what, one[what], many[what])


def _two_outputs(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10,))
    h = keras.layers.Dense(4 + seed, activation="relu")(inputs)
    a = keras.layers.Dense(1, activation="sigmoid", name="a")(h)
    b = keras.layers.Dense(2, name="b")(h)
    return keras.Model(inputs, [a, b])


def _two_output_compile():
    return {
        "optimizer": "adam",
        # b's of another reduction: vectorized over the members as Keras calls it.
        "loss": {"a": "binary_crossentropy", "b": keras.losses.MeanAbsoluteError(reduction="sum")},
        "loss_weights": {"a": 1.0, "b": 0.5},
        "metrics": {"a": ["accuracy", keras.metrics.AUC(name="auc")], "b": ["mse"]},
    }


@pytest.mark.parametrize("labels", ["list", "dict"])
def test_two_output_members_train_stacked_as_each_ones_own_fit(binary_data, labels):
    """Each output's loss (one of another reduction), its tracker (`a_loss`), loss
    weights, sample weights and the metrics of each output, computed stacked, equal every
    member's own fit and evaluate."""
    x, y = binary_data
    y_b = np.stack([x[:, 0], x[:, 1] - x[:, 2]], axis=1).astype("float32")
    y_both = [y, y_b] if labels == "list" else {"a": y, "b": y_b}
    # Keras takes sample weights with labels by output name only for outputs by name.
    sample_weight = np.random.default_rng(2).random(len(x)).astype("float32")
    sample_weight = sample_weight if labels == "list" else None
    members = [_two_outputs(s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(**_two_output_compile())
    kwargs = dict(sample_weight=sample_weight, batch_size=32, shuffle=False, verbose=0)
    history = pack.fit(x, y_both, epochs=2, **kwargs)
    assert pack.engine == "fused"
    assert len(pack.metrics_variables) < 3 * 6  # not every member's own trackers and metrics
    assert "step: loss" not in pack.fusion_report
    evaluated = pack.evaluate(x, y_both, return_dict=True, verbose=0)
    for i, twin in enumerate(twins):
        twin.compile(**_two_output_compile())
        own = twin.fit(x, y_both, epochs=2, **kwargs)
        alone = twin.evaluate(x, y_both, return_dict=True, verbose=0)
        assert {f"m{i}_{k}" for k in own.history} <= set(history.history)
        _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone, twin)


def test_two_output_members_of_different_losses_and_weights_train_stacked(binary_data):
    """Two-output members compiled each with its own Keras losses and loss weights (kept by
    `pack.compile` without a loss): each output's loss is a call per distinct loss on its
    members' rows, times each member's own weight; nothing is reported per member, and logs,
    `evaluate` and weights equal each member's own fit."""
    x, y = binary_data
    y_b = np.stack([x[:, 0], x[:, 1] - x[:, 2]], axis=1).astype("float32")
    own_losses = [
        ({"a": "binary_crossentropy", "b": "mae"}, {"a": 1.0, "b": 0.5}),
        ({"a": "binary_crossentropy", "b": "mse"}, {"a": 1.0, "b": 0.25}),
        ({"a": "binary_crossentropy", "b": keras.losses.Huber(delta=0.5)}, None),
    ]
    members = [_two_outputs(s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    for model in (*members, *twins):
        loss, weights = own_losses[(members + twins).index(model) % 3]
        model.compile(optimizer="adam", loss=loss, loss_weights=weights)
    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam")
    y_both = {"a": y, "b": y_b}
    kwargs = dict(batch_size=32, shuffle=False, verbose=0)
    history = pack.fit(x, y_both, epochs=2, **kwargs)
    evaluated = pack.evaluate(x, y_both, return_dict=True, verbose=0)
    assert pack.engine == "fused"
    assert "step: loss" not in pack.fusion_report
    for i, twin in enumerate(twins):
        own = twin.fit(x, y_both, epochs=2, **kwargs)
        alone = twin.evaluate(x, y_both, return_dict=True, verbose=0)
        assert {"a_loss", "b_loss"} <= set(own.history)
        _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone, twin)


def _unnamed_two_outputs(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10,))
    h = keras.layers.Dense(4 + seed, activation="relu")(inputs)
    return keras.Model(
        inputs, [keras.layers.Dense(1, activation="sigmoid")(h), keras.layers.Dense(2)(h)]
    )


def test_members_whose_outputs_are_named_apart_log_their_own_output_losses(binary_data):
    """Two-output members built without output names (Keras numbers each model's layers)
    compute their output losses stacked, and each logs them under its own output names
    (`m1_dense_5_loss`), as its own fit does; before, every member logged member 0's."""
    x, y = binary_data
    y_b = np.stack([x[:, 0], x[:, 1] - x[:, 2]], axis=1).astype("float32")
    members = [_unnamed_two_outputs(s) for s in range(2)]
    assert members[0].output_names != members[1].output_names
    twins = [copy_model(m) for m in members]
    args = dict(optimizer="adam", loss=["binary_crossentropy", "mae"], loss_weights=[1.0, 0.5])
    pack = kg.ModelPack(members)
    pack.compile(**args)
    kwargs = dict(batch_size=32, shuffle=False, verbose=0)
    history = pack.fit(x, [y, y_b], epochs=2, **kwargs)
    evaluated = pack.evaluate(x, [y, y_b], return_dict=True, verbose=0)
    assert pack.engine == "fused"
    assert "step: loss" not in pack.fusion_report
    for i, twin in enumerate(twins):
        twin.compile(**args)
        own = twin.fit(x, [y, y_b], epochs=2, **kwargs)
        alone = twin.evaluate(x, [y, y_b], return_dict=True, verbose=0)
        assert {f"{name}_loss" for name in members[i].output_names} <= set(own.history)
        _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone, twin)


@pytest.mark.parametrize(
    "config",
    # Where the step is counted, the counting test's fits train fused (`fit_one_batch`
    # asserts it): the others here.
    sorted(CONFIGS) if BACKEND == "torch" else sorted(set(CONFIGS) - set(COUNTED_CONFIGS)),
)
def test_every_counted_configuration_trains_fused(config):
    # The counted compile settings are valid fits on every backend, torch included.
    assert fit_one_batch(CONFIGS[config], 2, jit_compile=False)[0].engine == "fused"


def _regularized_member(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10,))
    h = keras.layers.Dense(
        6 + 3 * seed, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01 * seed)
    )(inputs)
    head = keras.layers.Dense(1, bias_regularizer=keras.regularizers.L1L2(0.02, 0.01 * seed))
    return keras.Model(inputs, head(h))


@pytest.mark.parametrize("loss", ["per_sample", "per_batch"])
def test_a_users_loss_and_members_regularizers_stacked_equal_each_ones_own_fit(binary_data, loss):
    """A user's loss function compiled into every member is vectorized over the members
    (one reducing over the batch itself too, weighted as Keras weighs its one value), and
    the members' own L2/L1L2 strengths act on their own padded slices: logs and weights
    equal each member's fit, and nothing is reported per member."""
    x, _ = binary_data
    y = (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")
    sample_weight = np.random.default_rng(3).random(len(x)).astype("float32")

    def per_batch(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred))

    fn = {"per_sample": smooth_error, "per_batch": per_batch}[loss]
    members = [_regularized_member(s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss=fn, metrics=["mae"])
    kwargs = dict(sample_weight=sample_weight, batch_size=32, shuffle=False, verbose=0)
    history = pack.fit(x, y, epochs=2, **kwargs)
    assert pack.engine == "fused"
    assert "step: loss" not in pack.fusion_report
    for i, twin in enumerate(twins):
        twin.compile(optimizer="adam", loss=fn, metrics=["mae"])
        own = twin.fit(x, y, epochs=2, **kwargs)
        for name in own.history:
            np.testing.assert_allclose(
                history.history[f"m{i}_{name}"], own.history[name], rtol=1e-5, atol=1e-6
            )
        for mine, theirs in zip(pack.member(i).get_weights(), twin.get_weights()):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights", ["sample", "class"])
def test_weighted_metrics_stacked_equal_each_ones_own_fit(binary_data, weights):
    """`weighted_metrics` beside `metrics` of the same names (Keras logs the weighted ones
    `weighted_<name>`), a confusion-matrix one among them, computed stacked with sample or
    class weights: logs and `evaluate` equal each member's own."""
    x, y = binary_data
    kwargs = dict(batch_size=32, shuffle=False, verbose=0)
    if weights == "sample":
        kwargs["sample_weight"] = np.random.default_rng(4).random(len(x)).astype("float32")
    else:
        kwargs["class_weight"] = {0: 0.3, 1: 1.7}

    def compile_args():
        return {
            "optimizer": "adam",
            "loss": "binary_crossentropy",
            "metrics": ["accuracy", keras.metrics.AUC(name="auc")],
            "weighted_metrics": ["accuracy", keras.metrics.AUC(name="auc"), "mae"],
        }

    members = [mlp(4 + 2 * s, seed=s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(**compile_args())
    history = pack.fit(x, y, epochs=2, **kwargs)
    assert pack.engine == "fused"
    assert len(pack.metrics_variables) < 3 * 6  # stacked, not every member's own
    weight = kwargs.get("sample_weight")
    evaluated = pack.evaluate(x, y, sample_weight=weight, return_dict=True, verbose=0)
    for i, twin in enumerate(twins):
        twin.compile(**compile_args())
        own = twin.fit(x, y, epochs=2, **kwargs)
        alone = twin.evaluate(x, y, sample_weight=weight, return_dict=True, verbose=0)
        assert {"weighted_accuracy", "weighted_auc", "mae"} <= set(own.history)
        _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone)


class _MeanPrediction(keras.metrics.Metric):
    """A user's stateful metric with no `get_config`: its members' metrics cannot be told
    alike, so it is computed member by member."""

    def __init__(self, name="mean_prediction", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.sum(keras.ops.cast(y_pred, "float32")))
        self.count.assign_add(keras.ops.cast(keras.ops.size(y_pred), "float32"))

    def result(self):
        return self.total / keras.ops.maximum(self.count, 1.0)


def _member_metrics(threshold):
    # F1, IoU and R2 make or shape their state on their first update; a user's metric and
    # a metric whose configuration differs per member (`hit`) are computed member by member.
    return [
        keras.metrics.F1Score(average="micro", threshold=0.5, name="f1"),
        keras.metrics.BinaryIoU(name="iou"),
        keras.metrics.R2Score(name="r2"),
        keras.metrics.RootMeanSquaredError(name="rmse"),
        _MeanPrediction(),
        keras.metrics.BinaryAccuracy(threshold=threshold, name="hit"),
    ]


def test_other_metric_kinds_stacked_and_the_rest_member_by_member(binary_data):
    """F-score, IoU, R2 and RMSE computed stacked; a user's metric and one configured per
    member computed member by member beside them, as `fusion_report` says; every figure
    equals the member's own fit and evaluate."""
    x, y = binary_data
    y = y.reshape(-1, 1).astype("float32")
    kwargs = dict(batch_size=32, shuffle=False, verbose=0)
    thresholds = (0.3, 0.5, 0.7)
    members = [mlp(4 + 3 * s, seed=s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(
        optimizer="adam",
        loss="binary_crossentropy",
        metrics=[_member_metrics(t) for t in thresholds],
    )
    history = pack.fit(x, y, epochs=2, **kwargs)
    evaluated = pack.evaluate(x, y, return_dict=True, verbose=0)
    assert pack.engine == "fused"
    report = pack.fusion_report
    assert "group 0's step: metrics computed member by member: " in report
    assert "mean_prediction (_MeanPrediction defines no `get_config`, " in report
    assert "hit (the members' metrics of this name differ)" in report
    assert ("iou (torch cannot vectorize its update)" in report) == (BACKEND == "torch")
    for name in ("f1", "r2", "rmse"):
        assert f"{name} (" not in report
    for i, (twin, threshold) in enumerate(zip(twins, thresholds)):
        twin.compile(
            optimizer="adam", loss="binary_crossentropy", metrics=_member_metrics(threshold)
        )
        own = twin.fit(x, y, epochs=2, **kwargs)
        alone = twin.evaluate(x, y, return_dict=True, verbose=0)
        assert set(own.history) == {"loss", "f1", "iou", "r2", "rmse", "mean_prediction", "hit"}
        _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone)


@pytest.mark.parametrize("labels", ["shared", "per_member"])
def test_a_users_metric_class_alike_for_every_member_is_computed_stacked(binary_data, labels):
    """A user's `Metric` class with a `get_config`, configured alike for every member, is
    tried once before the first step and, as its update maps over the members exactly,
    computed stacked from its own initial state (in `metrics` and `weighted_metrics`, with
    shared or per-member labels); one configured differently per member is computed member
    by member. Logs and `evaluate` equal each member's own fit."""
    x, y = binary_data
    rng = np.random.default_rng(7)
    weights = rng.random(len(x)).astype("float32")
    y_fit = y if labels == "shared" else [y, 1.0 - y, y]
    members = [mlp(4 + 2 * s, seed=s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    thresholds = (0.4, 0.5, 0.6)

    def compile_args(threshold):
        return {
            "optimizer": "adam",
            "loss": "binary_crossentropy",
            "metrics": [HitRate(0.5), HitRate(threshold, name="own_rate")],
            "weighted_metrics": [HitRate(0.5)],
        }

    pack = kg.ModelPack(members)
    pack.compile(
        **{
            **compile_args(0.5),
            "metrics": [[HitRate(0.5), HitRate(t, name="own_rate")] for t in thresholds],
        }
    )
    kwargs = dict(sample_weight=weights, batch_size=32, shuffle=False, verbose=0)
    history = pack.fit(x, y_fit, epochs=2, **kwargs)
    evaluated = pack.evaluate(x, y_fit, return_dict=True, verbose=0)
    assert pack.engine == "fused"
    report = pack.fusion_report
    assert "own_rate (the members' metrics of this name differ)" in report
    assert "hit_rate (" not in report
    for i, (twin, threshold) in enumerate(zip(twins, thresholds)):
        twin.compile(**compile_args(threshold))
        own_labels = y if labels == "shared" else y_fit[i]
        own = twin.fit(x, own_labels, epochs=2, **kwargs)
        alone = twin.evaluate(x, own_labels, return_dict=True, verbose=0)
        assert {"hit_rate", "own_rate", "weighted_hit_rate"} <= set(own.history)
        _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone)


def test_a_users_metric_used_before_packing_is_still_stacked(binary_data):
    """Members fitted alone before, whose metric objects hold state, keep their metrics
    (`compile` without `metrics`): the trial judges the class by a new metric of its
    configuration, so the column is still stacked."""
    x, y = binary_data
    members = [mlp(4 + s, seed=s) for s in range(2)]
    for member in members:
        member.compile(optimizer="adam", loss="binary_crossentropy", metrics=[HitRate()])
        member.fit(x, y, epochs=1, verbose=0)
    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss="binary_crossentropy")
    pack.fit(x, y, epochs=1, verbose=0)
    assert "hit_rate (" not in pack.fusion_report


class _SummedError(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.abs(y_true - y_pred) + 0.5 * keras.ops.square(y_true - y_pred)


@pytest.mark.parametrize("reductions", ["default", "other"])
def test_members_of_different_losses_are_computed_a_group_a_loss(binary_data, reductions):
    """Members compiled with different losses (Keras's own by configuration, a user's by
    identity), of the default reduction or others (`sum`, `mean_with_sample_weight`),
    are computed one call per loss on their rows of the stacked predictions: logs,
    `evaluate` and weights equal each member's own fit, and nothing is reported per member."""
    x, _ = binary_data
    y = (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")
    sample_weight = np.random.default_rng(5).random(len(x)).astype("float32")
    losses = ["mse", "mae", smooth_error, keras.losses.Huber(delta=0.5), "mse"]
    if reductions == "other":
        losses = [
            keras.losses.MeanSquaredError(reduction="sum"),
            keras.losses.Huber(delta=0.5, reduction="mean_with_sample_weight"),
            _SummedError(reduction="sum"),
            "mae",
        ]
    members = [mlp(4 + s, seed=s, out=None) for s in range(len(losses))]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss=losses, metrics=["mae"])
    kwargs = dict(sample_weight=sample_weight, batch_size=32, shuffle=False, verbose=0)
    history = pack.fit(x, y, epochs=2, **kwargs)
    evaluated = pack.evaluate(x, y, return_dict=True, verbose=0)
    assert pack.engine == "fused"
    assert "step: loss" not in pack.fusion_report
    for i, (twin, loss) in enumerate(zip(twins, losses)):
        twin.compile(optimizer="adam", loss=loss, metrics=["mae"])
        own = twin.fit(x, y, epochs=2, **kwargs)
        alone = twin.evaluate(x, y, return_dict=True, verbose=0)
        _assert_member_is_its_own_fit(pack, i, history, evaluated, own, alone, twin)
