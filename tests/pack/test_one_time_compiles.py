"""On JAX, the XLA programs a pack compiles before its steady state do not grow with N.

Counted with `jax_log_compiles`, JAX's caches cleared before each pack, for packs of the same
members at two sizes: from `ModelPack(members)` through `compile` and the first epoch (where
the training step itself is compiled). The stacked weights are not drawn from the members'
random initializers either (the converter loads the members' values into them): a compiled
random draw per stacked shape was most of a JAX pack's one-time cost. Besides its training
step, a pack compiles only programs a plain `fit` compiles too: none to build (stacked
values and zeros are transferred, not staged by a program per shape), none to read its
stacked figures at an epoch's end.
"""

import logging

import keras
import numpy as np
import pytest

import keras_gpushare as kg

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA programs of JAX")


class _Compiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.programs: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.programs.append(message.split()[1])


def _training(program: str) -> bool:
    """Whether `program` is the training step: Keras's, or the pack's device loop over it
    and its step for a batch alone at the end of its calls."""
    return "train_step" in program or program in ("jit(loop)", "jit(last_batch)")


def _member(width: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def _plain_programs() -> list[str]:
    """The programs one member's plain `compile` and first `fit` compile."""
    import jax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    member = _member(8, seed=0)
    jax.clear_caches()
    counter = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    try:
        with jax.log_compiles(True):
            member.compile(optimizer="adam", loss="mse")
            member.fit(x, y, batch_size=16, epochs=1, verbose=0)
    finally:
        logger.removeHandler(counter)
    return counter.programs


def _programs_until_steady(n: int) -> dict[str, list[str]]:
    import jax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    members = [_member((4, 8, 12)[i % 3], seed=i) for i in range(n)]
    jax.clear_caches()
    counter = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    phases = {}
    try:
        with jax.log_compiles(True):
            pack = kg.ModelPack(members)
            phases["build"], counter.programs = counter.programs, []
            pack.compile(optimizer="adam", loss="mse")
            pack.fit(x, y, batch_size=16, epochs=1, verbose=0)
            phases["first epoch"], counter.programs = counter.programs, []
            pack.fit(x, y, batch_size=16, epochs=1, verbose=0)
            phases["steady"] = counter.programs
    finally:
        logger.removeHandler(counter)
    assert pack.engine == "fused", pack.fusion_report
    return phases


@pytest.fixture(scope="module")
def programs():
    return {n: _programs_until_steady(n) for n in (3, 12)}


def test_programs_compiled_before_the_steady_state_do_not_grow_with_n(programs):
    small, large = programs[3], programs[12]
    for phase in ("build", "first epoch"):
        assert len(large[phase]) == len(small[phase]), (phase, small[phase], large[phase])
    assert small["steady"] == large["steady"] == []
    # The first epoch compiles the training step once (its 4 batches in one device loop).
    assert [name for name in large["first epoch"] if _training(name)] == ["jit(loop)"], large


def test_stacked_weights_are_not_drawn_from_random_initializers(programs):
    build = programs[12]["build"]
    assert not [name for name in build if "uniform" in name or "normal" in name], build


def test_building_a_pack_compiles_no_program(programs):
    assert programs[3]["build"] == programs[12]["build"] == []


def test_beside_its_step_a_pack_compiles_only_what_a_plain_fit_compiles(programs):
    plain = set(_plain_programs())
    first = [name for name in programs[12]["first epoch"] if not _training(name)]
    assert set(first) <= plain, (sorted(set(first) - plain), sorted(plain))
