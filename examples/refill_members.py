"""Members replaced in place: a pack keeps its compiled step while new models take turns.

A pack of 4 learning-rate candidates trains for a few epochs; at each epoch's end the
worst member's slot is refilled with a new candidate (same layers, another learning rate,
new initial weights) by `pack.load_member`. The pack is not built, fused or compiled again:
the refilled member trains from the next epoch as the new model would alone.

    python examples/refill_members.py
"""

import os

import keras
import numpy as np

import keras_gpushare as kg

QUICK = os.environ.get("KERAS_GPUSHARE_QUICK") == "1"  # the test suite's short run


def build(rate: float, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(rate), loss="mse")
    return model


rng = np.random.default_rng(0)
x = rng.normal(size=(512 if QUICK else 8192, 20)).astype("float32")
y = (x[:, :5].sum(axis=1, keepdims=True) + 0.1 * rng.normal(size=(len(x), 1))).astype("float32")

rates = [3e-4, 1e-3, 3e-3, 1e-2]
waiting = [(rate, seed) for seed, rate in enumerate([1e-4, 2e-3, 5e-3, 3e-2], start=10)]
pack = kg.ModelPack([build(rate, seed) for seed, rate in enumerate(rates)])
pack.compile()
in_slot = list(rates)


class RefillWorst(keras.callbacks.Callback):
    """At each epoch's end, the member with the highest loss makes room for a new one."""

    def on_epoch_end(self, epoch, logs=None):
        if not waiting or epoch == self.params["epochs"] - 1:
            return
        worst = int(np.argmax([logs[f"m{i}_loss"] for i in range(len(in_slot))]))
        rate, seed = waiting.pop(0)
        print(f"epoch {epoch}: member {worst} (lr {in_slot[worst]:g}) makes room for lr {rate:g}")
        pack.load_member(worst, build(rate, seed))
        in_slot[worst] = rate


pack.fit(x, y, batch_size=64, epochs=2 if QUICK else 6, verbose=0, callbacks=[RefillWorst()])
for i, rate in enumerate(in_slot):
    loss = pack.member(i).evaluate(x, y, verbose=0)
    print(f"member {i}: lr {rate:g}, loss {loss:.4f}")
