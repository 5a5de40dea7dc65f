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


def test_a_fit_compiles_the_loop_once_and_the_short_batch_once(compile_log):
    x, y = _data()
    pack = kg.ModelPack([mlp(w, seed=s) for s, w in enumerate((4, 9))])
    pack.compile(
        optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"], steps_per_execution=8
    )
    pack.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    training = [name for name in _compiled(compile_log) if name in ("loop", "train_step")]
    # Keras's own loop would compile `train_step` twice (32 and 7 rows) and never `loop`.
    assert sorted(training) == ["loop", "train_step"]
    compile_log.clear()
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert [n for n in _compiled(compile_log) if n in ("loop", "train_step")] == []


def test_the_loop_holds_the_step_once_whatever_the_batches_per_call():
    import jax

    from keras_gpushare.pack import _device_loop

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
