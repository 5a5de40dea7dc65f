"""On JAX, a call of several batches is one compiled device loop, batch for batch the same
training as Keras's Python loop of one-batch calls (and as each member's own `fit`).

JAX only (make test runs it with `KERAS_BACKEND=jax`): TensorFlow and torch run Keras's own
loops.
"""

import logging
import re

import keras
import numpy as np
import pytest
from pack_builders import copy_model, mlp

import keras_gpushare as kg

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the device loop is the JAX backend's"
)


def _data():
    # 10 full batches of 32 and a short one of 7: a call of 8 batches, then 2 and the short one.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(327, 10)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")
    return x, y


def _compiled(caplog) -> list[str]:
    """The names of the functions JAX compiled, from its compile log."""
    found = (re.match(r"Compiling jit\((\w+)\)", r.getMessage()) for r in caplog.records)
    return [match.group(1) for match in found if match]


@pytest.fixture
def compile_log(caplog):
    import jax

    jax.config.update("jax_log_compiles", True)
    caplog.set_level(logging.WARNING, logger="jax")
    try:
        yield caplog
    finally:
        jax.config.update("jax_log_compiles", False)


def test_calls_of_many_batches_train_each_member_as_its_own_fit():
    x, y = _data()
    members = [mlp(w, seed=s) for s, w in enumerate((4, 9, 16))]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(
        optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"], steps_per_execution=8
    )
    history = pack.fit(
        x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, validation_data=(x[:100], y[:100])
    )
    evaluated = pack.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
    for i, twin in enumerate(twins):
        twin.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
        own = twin.fit(
            x,
            y,
            batch_size=32,
            epochs=3,
            shuffle=False,
            verbose=0,
            validation_data=(x[:100], y[:100]),
        )
        for name in ("loss", "accuracy"):
            for prefix in ("", "val_"):
                np.testing.assert_allclose(
                    history.history[f"{prefix}m{i}_{name}"],
                    own.history[prefix + name],
                    rtol=1e-5,
                    atol=1e-6,
                )
        alone = twin.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
        for name in ("loss", "accuracy"):
            np.testing.assert_allclose(evaluated[f"m{i}_{name}"], alone[name], rtol=1e-5)
        for mine, theirs in zip(pack.member(i).get_weights(), twin.get_weights()):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
        assert int(pack.member(i).optimizer.iterations) == int(twin.optimizer.iterations) == 33


_TRAINING = ("loop", "train_step", "last_batch")


def test_a_fit_compiles_the_loop_once_and_the_short_batch_once(compile_log):
    x, y = _data()
    pack = kg.ModelPack([mlp(w, seed=s) for s, w in enumerate((4, 9))])
    pack.compile(
        optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"], steps_per_execution=8
    )
    pack.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    training = [name for name in _compiled(compile_log) if name in _TRAINING]
    # Keras's own loop would compile `train_step` twice (32 and 7 rows) and never `loop`;
    # the short batch, alone at the end of its calls, is the cheaply compiled `last_batch`.
    assert sorted(training) == ["last_batch", "loop"]
    compile_log.clear()
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert [n for n in _compiled(compile_log) if n in _TRAINING] == []


class _Alternating(keras.utils.PyDataset):
    """Batches of 32 and 7 rows in turn: no shape ends every call it runs in."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.bounds = [0]
        while self.bounds[-1] < len(x):
            self.bounds.append(min(len(x), self.bounds[-1] + (32, 7)[len(self.bounds) % 2 - 1]))

    def __len__(self):
        return len(self.bounds) - 1

    def __getitem__(self, index):
        rows = slice(self.bounds[index], self.bounds[index + 1])
        return self.x[rows], self.y[rows]


def test_batches_of_varying_shapes_run_the_step_compiled_as_the_loops_body(compile_log):
    x, y = _data()
    data = _Alternating(x[:312], y[:312])  # 8 batches of 32 and 8 of 7: two calls of 8
    members = [mlp(w, seed=s) for s, w in enumerate((4, 9))]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="sgd", loss="binary_crossentropy", steps_per_execution=8)
    history = pack.fit(data, epochs=2, shuffle=False, verbose=0)
    training = [name for name in _compiled(compile_log) if name in _TRAINING]
    # Each shape runs alone, and not only at a call's end: both fully compiled, once.
    assert sorted(training) == ["train_step", "train_step"]
    for i, twin in enumerate(twins):
        twin.compile(optimizer="sgd", loss="binary_crossentropy")
        own = twin.fit(data, epochs=2, shuffle=False, verbose=0)
        np.testing.assert_allclose(history.history[f"m{i}_loss"], own.history["loss"], rtol=1e-5)
        for mine, theirs in zip(pack.member(i).get_weights(), twin.get_weights()):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_the_last_batch_options_are_xlas():
    import jax

    from keras_gpushare.pack._loop import _device_loop

    # A release of XLA without the option refuses it here, as it would in a user's `fit`.
    square = jax.jit(lambda v: v * v, compiler_options=_device_loop.LAST_BATCH_OPTIONS)
    np.testing.assert_array_equal(square(np.arange(3.0)), [0.0, 1.0, 4.0])


def test_the_loop_holds_the_step_once_whatever_the_batches_per_call():
    import jax

    from keras_gpushare.pack._loop import _device_loop

    x, y = _data()
    pack = kg.ModelPack([mlp(w, seed=s) for s, w in enumerate((4, 9))])
    pack.compile(
        optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"], steps_per_execution=8
    )
    pack.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    # The state Keras's JAX `fit` passes its training function.
    state = tuple(
        [v.value for v in variables]
        for variables in (
            pack.trainable_variables,
            pack.non_trainable_variables,
            pack.optimizer.variables,
            pack.metrics_variables,
        )
    )
    one = jax.jit(pack.train_step)
    dots = {}
    for size in (2, 16):
        batches = (np.stack([x[:32]] * size), np.stack([y[:32]] * size))
        text = (
            jax.jit(_device_loop._looping(one))
            .lower(state, batches, np.int32(size))
            .compile()
            .as_text()
        )
        assert " while(" in text
        dots[size] = text.count(" dot(")
    one_step = one.lower(state, (x[:32], y[:32])).compile().as_text().count(" dot(")
    assert dots[2] == dots[16] == one_step
