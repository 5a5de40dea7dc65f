"""What a pack prints and counts, against what its members print and count alone (issue 24.5).

The progress bar counts batches as a plain `fit` does (never `64/16` under
`steps_per_execution="auto"`), shows members in numeric order (a traced step returns its
figures sorted as strings: m0, m10, m11, ..., m1), and past the terminal's width shows the
pack's own figures with one line per member at the end of the epoch. `summary()` has a row
per member and each member's own summary; `count_params()` counts the members' weights, not
the fused engine's padded ones. Runs on TensorFlow and JAX.
"""

import keras
import numpy as np
import pytest

import keras_gpushare as kg

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 5)).astype("float32")
Y = RNG.normal(size=(64, 1)).astype("float32")
BATCH = 4  # 16 batches an epoch


def mlp(i):
    keras.utils.set_random_seed(i)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4 + i, activation="relu"), keras.layers.Dense(1)],
        name=f"mlp{i}",
    )


def pack_of(n):
    pack = kg.ModelPack([mlp(i) for i in range(n)])
    pack.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return pack


@pytest.fixture
def bar_updates(monkeypatch):
    """Every `keras.utils.Progbar.update` call: (current, target, figure names)."""
    calls = []
    update = keras.utils.Progbar.update

    def record(self, current, values=None, finalize=None):
        calls.append((current, self.target, [name for name, _ in values or []]))
        return update(self, current, values, finalize)

    monkeypatch.setattr(keras.utils.Progbar, "update", record)
    return calls


def test_the_bar_counts_batches_as_a_plain_fit(bar_updates, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")
    model = mlp(0)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=1)
    alone = [(current, target) for current, target, _ in bar_updates]
    assert alone[-1] == (16, 16) and all(c <= t for c, t in alone), alone
    bar_updates.clear()
    pack = pack_of(3)
    pack.fit(X, Y, batch_size=BATCH, epochs=1, verbose=1)
    pack.evaluate(X, Y, batch_size=BATCH, verbose=1)
    pack.predict(X, batch_size=BATCH, verbose=1)
    counts = [(current, target) for current, target, _ in bar_updates]
    assert all(c <= t for c, t in counts), counts
    assert counts[-1] == (16, 16), counts


def test_members_are_shown_in_numeric_order(bar_updates, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")
    pack = pack_of(12)
    pack.fit(X, Y, batch_size=BATCH, epochs=1, verbose=1, validation_split=0.25)
    names = bar_updates[-1][2]
    train = ["loss"] + [f"m{i}_{k}" for i in range(12) for k in ("loss", "mae")]
    val = ["val_loss"] + [f"val_m{i}_{k}" for i in range(12) for k in ("loss", "mae")]
    assert names == train + val


def test_many_members_print_one_line_each_after_the_bar(bar_updates, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "120")
    pack = pack_of(16)
    history = pack.fit(X, Y, batch_size=BATCH, epochs=2, verbose=2, validation_split=0.25)
    assert {tuple(names) for _, _, names in bar_updates} <= {("loss",), ("loss", "val_loss")}
    printed = capsys.readouterr().out.splitlines()
    lines = [line.strip() for line in printed if line.strip().startswith("m")]
    assert len(lines) == 2 * 16
    h = history.history
    for i, line in enumerate(lines[16:]):
        assert line.split(" - ")[0].strip() == f"m{i}"
        assert f"loss: {h[f'm{i}_loss'][-1]:.4f}" in line
        assert f"val_mae: {h[f'val_m{i}_mae'][-1]:.4f}" in line
    assert max(len(line) for line in printed) < 200


def test_count_params_counts_the_members_own_weights():
    pack = pack_of(4)
    assert pack.engine == "fused"
    alone = sum(mlp(i).count_params() for i in range(4))
    assert pack.count_params() == alone
    stored = sum(int(np.prod(v.shape)) for v in pack.trainable_weights)
    assert stored > alone  # the padded stacked weights


def test_summary_has_a_row_and_the_own_summary_of_each_member():
    pack = pack_of(3)
    text = []
    pack.summary(expand_nested=True, print_fn=lambda line, **kwargs: text.append(line))
    table = text[0]
    for i in range(3):
        row = next(line for line in table.splitlines() if line.startswith(f"m{i} "))
        assert f"mlp{i} (Sequential)" in row and f"{mlp(i).count_params():,}" in row
        own = []
        pack.members[i].summary(print_fn=lambda line, own=own, **kwargs: own.append(line))
        assert "\n".join(own) in "\n".join(text)
    assert f"Total params: {pack.count_params():,}" in table
