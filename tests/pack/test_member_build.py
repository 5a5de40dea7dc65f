"""A pack builds its members' compiled losses and metrics as Keras's own first `fit` would.

`members.build_member` builds them from the members' output shapes instead of tracing each
member; the reference is the same model built by Keras (`_symbolic_build`) and trained with
plain `fit`. Backend-neutral.
"""

import keras
import numpy as np
import pytest

from keras_gpushare import _upstream
from keras_gpushare.pack import members as members_lib


def classifier(seed, outputs=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(outputs, activation="softmax"),
        ]
    )


def two_heads(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(
        inputs,
        {
            "label": keras.layers.Dense(3, activation="softmax", name="label")(h),
            "score": keras.layers.Dense(1, name="score")(h),
        },
    )


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 6)).astype("float32")
    return x, rng.integers(0, 3, size=(32,)).astype("int32")


def compiled_twins(build, **compile_args):
    models = [build(0), build(0)]
    for model in models:
        model.compile(optimizer=keras.optimizers.Adam(0.01), **compile_args)
    return models


def built_state(model):
    metrics = _upstream.compile_metrics(model)
    loss = _upstream.compile_loss(model)
    return (
        [(type(m).__name__, m.name) for m in metrics.metrics] if metrics else [],
        [m.name for m in loss.metrics] if loss else [],
        len(model.optimizer.variables),
    )


@pytest.mark.parametrize(
    "metrics, sparse",
    [
        (["accuracy"], True),
        (["accuracy", "sparse_categorical_crossentropy"], True),
        (["accuracy", "auc", keras.metrics.Precision(name="p")], False),
        (["f1_score"], False),
        (["accuracy", keras.metrics.R2Score(), keras.metrics.AUC(multi_label=True)], False),
    ],
    ids=["accuracy", "two-mean-metrics", "confusion", "f1", "state-from-a-batch"],
)
def test_a_built_member_trains_as_keras_builds_it(metrics, sparse):
    x, y = data()
    if sparse:
        y_fit, loss = y, "sparse_categorical_crossentropy"
    else:
        y_fit, loss = keras.utils.to_categorical(y, 3), "categorical_crossentropy"
    ours, keras_own = compiled_twins(classifier, loss=loss, metrics=metrics)
    batch = (x[:8], y_fit[:8])
    members_lib.build_member(ours, batch)
    _upstream.symbolic_build(keras_own, batch)
    assert built_state(ours) == built_state(keras_own)
    logs = [
        m.fit(x, y_fit, batch_size=8, epochs=2, shuffle=False, verbose=0) for m in (ours, keras_own)
    ]
    for key in logs[1].history:
        np.testing.assert_allclose(logs[0].history[key], logs[1].history[key], rtol=1e-6)
    for a, b in zip(ours.get_weights(), keras_own.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("score_metrics", [["mae"], ["mae", "r2_score"]], ids=["means", "r2"])
def test_a_member_with_named_outputs_builds_per_output_losses_and_metrics(score_metrics):
    x, y = data()
    score = np.linspace(-1, 1, len(x)).astype("float32")[:, None]
    labels = {"label": y, "score": score}
    args = dict(
        loss={"label": "sparse_categorical_crossentropy", "score": "mse"},
        metrics={"label": ["accuracy"], "score": score_metrics},
        weighted_metrics={"score": ["mae"]},
    )
    ours, keras_own = compiled_twins(two_heads, **args)
    batch = (x[:8], {"label": y[:8], "score": score[:8]})
    members_lib.build_member(ours, batch)
    _upstream.symbolic_build(keras_own, batch)
    assert built_state(ours) == built_state(keras_own)
    logs = [
        m.fit(x, labels, batch_size=8, epochs=1, shuffle=False, verbose=0)
        for m in (ours, keras_own)
    ]
    assert sorted(logs[0].history) == sorted(logs[1].history)
    for key in logs[1].history:
        np.testing.assert_allclose(logs[0].history[key], logs[1].history[key], rtol=1e-6)


def test_building_a_member_runs_its_model_only_where_keras_must():
    """A member with a layer graph is built from its outputs' shapes: its model is never
    called, whatever its metrics (those that shape their state from a first batch have
    their updates traced on symbolic values); a subclassed model takes Keras's way."""
    x, y = data()
    calls = []

    class Counting(keras.layers.Layer):
        def call(self, inputs):
            calls.append(1)
            return inputs

    def counted(seed):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(3, activation="softmax")(Counting()(inputs))
        return keras.Model(inputs, outputs)

    metrics = ["accuracy", "auc", keras.metrics.F1Score()]
    model = counted(0)
    model.compile(optimizer="sgd", loss="categorical_crossentropy", metrics=metrics)
    calls.clear()
    members_lib.build_member(model, (x[:8], keras.utils.to_categorical(y[:8], 3)))
    assert calls == []
    assert all(not _upstream.metric_state_pending(m) for m in model.metrics[1].metrics)


def test_a_fused_members_optimizer_is_built_when_its_state_is_read():
    """The pack trains fused members with its own stacked optimizer: their optimizers are
    built only when a member's state is read, and then hold what a plain fit holds."""
    import keras_gpushare as kg

    x, y = data()
    members = [classifier(seed) for seed in (1, 2)]
    twins = [classifier(seed) for seed in (1, 2)]
    pack = kg.ModelPack(members, fuse=True)
    pack.compile(
        optimizer=[keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1, momentum=0.9)],
        loss="sparse_categorical_crossentropy",
    )
    pack.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert [m.optimizer.built for m in members] == [False, False]
    views = pack.members
    for view, twin, optimizer in zip(
        views, twins, [keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1, momentum=0.9)]
    ):
        twin.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        assert int(view.optimizer.iterations) == int(twin.optimizer.iterations) == 8
        for a, b in zip(view.optimizer.variables, twin.optimizer.variables):
            np.testing.assert_allclose(
                keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), rtol=1e-5, atol=1e-6
            )
