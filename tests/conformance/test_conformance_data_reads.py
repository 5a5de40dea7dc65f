"""A pack reads the data as plain `fit` reads it (issue 24 items 1 and 2).

The reference is plain Keras on the same model and data: how many optimizer steps an epoch
takes when the user counts them (`steps_per_epoch`, `evaluate(steps=...)`,
`predict(steps=...)`), and how many batches a `keras.utils.PyDataset` is asked for.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_gpushare as kg

ROWS = 160  # 10 batches of 16


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    return x, (x[:, :1] - x[:, 1:2]).astype("float32")


def _member(i: int) -> keras.Model:
    keras.utils.set_random_seed(10 + i)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    )


class _Counted(keras.utils.PyDataset):
    def __init__(self, x, y, **kwargs) -> None:
        super().__init__(**kwargs)
        self.x, self.y, self.reads = x, y, 0

    def __len__(self) -> int:
        return len(self.x) // 16

    def __getitem__(self, index: int):
        self.reads += 1
        return self.x[index * 16 : (index + 1) * 16], self.y[index * 16 : (index + 1) * 16]


def _trained_alone(i: int, fit) -> keras.Model:
    model = _member(i)
    model.compile(optimizer=keras.optimizers.SGD(0.05 * (i + 1)), loss="mse")
    fit(model)
    return model


def _pack(n: int = 2) -> kg.ModelPack:
    pack = kg.ModelPack([_member(i) for i in range(n)])
    pack.compile(optimizer=[keras.optimizers.SGD(0.05 * (i + 1)) for i in range(n)], loss="mse")
    return pack


def _assert_same_weights(pack: kg.ModelPack, twins: list[keras.Model]) -> None:
    for member, twin in zip(pack.members, twins):
        for a, b in zip(member.get_weights(), twin.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_py_dataset_is_asked_for_the_batches_plain_fit_asks_for(workers):
    x, y = _data()
    sizes = []

    def fit(model):
        data = _Counted(x, y, workers=workers)
        model.fit(data, epochs=2, shuffle=False, verbose=0)
        sizes.append(data.reads)
        return model

    twins = [_trained_alone(i, fit) for i in range(2)]
    pack = _pack()
    fit(pack)
    assert sizes[0] == sizes[1]  # plain Keras is itself repeatable here
    assert sizes[2] == sizes[0]
    _assert_same_weights(pack, twins)


def test_steps_per_epoch_is_the_number_of_steps_an_epoch_takes():
    x, y = _data()

    def fit(model):
        model.fit(x, y, batch_size=16, steps_per_epoch=3, epochs=2, shuffle=False, verbose=0)

    twins = [_trained_alone(i, fit) for i in range(2)]
    pack = _pack()
    fit(pack)
    assert [int(m.optimizer.iterations) for m in pack.members] == [6, 6]
    assert [int(t.optimizer.iterations) for t in twins] == [6, 6]
    _assert_same_weights(pack, twins)


def test_evaluate_and_predict_read_only_the_steps_asked_for():
    x, y = _data()
    members = [_member(i) for i in range(2)]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="sgd", loss="mse")
    logs = pack.evaluate(x, y, batch_size=16, steps=3, return_dict=True, verbose=0)
    predictions = pack.predict(x, batch_size=16, steps=3, verbose=0)
    for i in range(2):
        alone = _member(i)
        alone.compile(optimizer="sgd", loss="mse")
        expected = alone.evaluate(x, y, batch_size=16, steps=3, return_dict=True, verbose=0)
        np.testing.assert_allclose(logs[f"m{i}_loss"], expected["loss"], rtol=1e-5)
        expected = alone.predict(x, batch_size=16, steps=3, verbose=0)
        assert predictions[i].shape == expected.shape == (48, 1)
        np.testing.assert_allclose(predictions[i], expected, atol=1e-6)
