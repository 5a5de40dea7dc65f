"""Edges of `fit` where a pack must still be N fits (issue 35 item 6).

Each test trains every member alone with plain Keras (its twin: same initial weights, same
`compile` and `fit` arguments, same seeds) and in a pack, and compares them:

- a fit whose data raises mid-epoch: the steps before the failure are kept, each member's
  optimizer counts what the member's own `fit` counts, and a further `fit` continues alike;
- a seeded `fit(shuffle=True)`: the pack draws the same random numbers, so it shuffles in
  the same order (a second fit and validation included);
- one list of inputs: a multi-input member's own form trains as alone, a dict gives members
  different inputs, and one `x` per member is refused before any step, naming the member.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conformance_harness import PACK_ENGINES

import keras_gpushare as kg

BATCH = 16
BATCHES = 12
FAILING = 9  # the data raises when asked for batch 9: batches 0-8 were served
LEARNING_RATES = (0.01, 0.02)


def _data(width: int = 5, rows: int = BATCH * BATCHES, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, width)).astype("float32")
    return x, (x[:, :1] - x[:, 1:2]).astype("float32")


def _member(i: int, width: int = 5, name: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(10 + i)
    inputs = keras.Input((width,), name=name)
    hidden = keras.layers.Dense(4, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def _adam(i: int) -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(LEARNING_RATES[i])


def _twins(members: list[keras.Model]) -> list[keras.Model]:
    twins = []
    for i, member in enumerate(members):
        twin = keras.models.clone_model(member)
        twin.set_weights(member.get_weights())
        twin.compile(optimizer=_adam(i), loss="mse")
        twins.append(twin)
    return twins


def _pack(members: list[keras.Model], engine: str = "fused") -> kg.ModelPack:
    pack = kg.ModelPack(members, fuse=False if engine == "graph" else "auto")
    pack.compile(optimizer=[_adam(i) for i in range(len(members))], loss="mse")
    return pack


def _max_difference(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


def _assert_same_weights(pack: kg.ModelPack, twins: list[keras.Model], what: str) -> None:
    for i, (member, twin) in enumerate(zip(pack.members, twins)):
        for k, (a, b) in enumerate(zip(member.get_weights(), twin.get_weights())):
            np.testing.assert_allclose(
                a,
                b,
                atol=1e-5,
                rtol=1e-5,
                err_msg=f"{what}: member {i} weight {k} (max difference "
                f"{_max_difference(member, twin):.3g}, engine {pack.engine})",
            )


# A fit whose data raises -------------------------------------------------------------------


def _failing_generator(x, y):
    for b in range(BATCHES):
        if b == FAILING:
            raise RuntimeError("the loader broke")
        yield x[b * BATCH : (b + 1) * BATCH], y[b * BATCH : (b + 1) * BATCH]


class _FailingPyDataset(keras.utils.PyDataset):
    def __init__(self, x, y) -> None:
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, index: int):
        if index == FAILING:
            raise RuntimeError("the loader broke")
        return self.x[index * BATCH : (index + 1) * BATCH], self.y[
            index * BATCH : (index + 1) * BATCH
        ]


def _fit_until_the_data_raises(model: keras.Model, source: str) -> None:
    x, y = _data()
    if source == "generator":
        data, kwargs = _failing_generator(x, y), {"steps_per_epoch": BATCHES}
    else:
        data, kwargs = _FailingPyDataset(x, y), {}
    with pytest.raises(Exception, match="the loader broke"):
        model.fit(data, epochs=1, shuffle=False, verbose=0, **kwargs)


@pytest.mark.parametrize("engine", PACK_ENGINES)
@pytest.mark.parametrize("source", ["generator", "py_dataset"])
def test_a_fit_whose_data_raises_keeps_what_plain_fit_keeps(engine, source):
    members = [_member(i) for i in range(2)]
    twins = _twins(members)
    pack = _pack(members, engine)
    for model in (*twins, pack):
        _fit_until_the_data_raises(model, source)
    counts = [int(m.optimizer.iterations) for m in pack.members]
    expected = [int(t.optimizer.iterations) for t in twins]
    assert counts == expected, (
        f"optimizer iterations {counts} in the pack (engine {pack.engine}), {expected} for "
        f"the members alone, after {FAILING} batches were served"
    )
    _assert_same_weights(pack, twins, "after the fit that raised")
    x, y = _data(seed=1)
    for model in (*twins, pack):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(pack, twins, "after a further epoch")


# A seeded, shuffled fit --------------------------------------------------------------------


def test_a_seeded_shuffled_fit_shuffles_as_plain_fit():
    x, y = _data()
    validation = _data(seed=1)

    def train(model):
        for seed in (7, 8):  # a second fit reads the data of a model built by the first
            keras.utils.set_random_seed(seed)
            model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=2,
                shuffle=True,
                validation_data=validation,
                verbose=0,
            )

    members = [_member(i) for i in range(2)]
    twins = _twins(members)
    pack = _pack(members)
    for model in (*twins, pack):
        train(model)
    _assert_same_weights(pack, twins, "after seeded shuffled fits")


# Lists of inputs ---------------------------------------------------------------------------


def _two_input_member(i: int) -> keras.Model:
    keras.utils.set_random_seed(10 + i)
    a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
    joined = keras.layers.Concatenate()([keras.layers.Dense(4)(a), keras.layers.Dense(4)(b)])
    return keras.Model([a, b], keras.layers.Dense(1)(joined))


@pytest.mark.parametrize("n", [1, 2])
def test_a_list_of_inputs_is_each_multi_input_members_own_form(n):
    x_a, y = _data()
    x_b, _ = _data(width=3, seed=1)
    members = [_two_input_member(i) for i in range(n)]
    twins = _twins(members)
    pack = _pack(members)
    for model in (*twins, pack):
        model.fit([x_a, x_b], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(pack, twins, f"fit([x_a, x_b], y) of {n} two-input member(s)")


def test_members_of_different_inputs_read_their_own_keys_of_a_dict():
    x_a, y = _data()
    x_b, _ = _data(width=3, seed=1)
    members = [_member(0, 5, name="a"), _member(1, 3, name="b")]
    twins = _twins(members)
    pack = _pack(members)
    for twin, own in zip(twins, (x_a, x_b)):
        twin.fit(own, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    pack.fit({"a": x_a, "b": x_b}, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(pack, twins, "fit({'a': x_a, 'b': x_b}, y)")


def test_one_x_per_member_is_refused_before_any_step_naming_the_member():
    x_a, y = _data()
    x_b, _ = _data(width=3, seed=1)
    members = [_member(0, 5, name="a"), _member(1, 3, name="b")]
    pack = _pack(members)
    before = [m.get_weights() for m in members]
    with pytest.raises(ValueError) as raised:
        pack.fit([x_a, x_b], y, batch_size=BATCH, epochs=1, verbose=0)
    message = str(raised.value)
    for part in (
        "Invalid inputs for member 0",
        "list of 2 arrays",
        "{'a': (None, 5)}",
        "one `x` per member",
        "a dict keyed by the members' `keras.Input` names",
        "['a', 'b']",
    ):
        assert part in message, f"{part!r} not in the message: {message}"
    for member, weights in zip(pack.members, before):
        for a, b in zip(member.get_weights(), weights):
            np.testing.assert_array_equal(a, b)
