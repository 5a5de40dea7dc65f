"""A pack's compiled program is reused by a later pack of the same signature (JAX).

With JAX's persistent compilation cache turned on by the user, a pack whose groups have the
same templates, shapes, batch size and compile arguments as one compiled before (in this
process or an earlier one) compiles nothing new: member weights and learning rates are data
of the program, not part of it. Checked in a fresh process (the cache is process-wide JAX
configuration), by the programs the cache holds after each pack.
"""

import json
import os
import subprocess
import sys

import keras
import pytest
from hang_guard import HANG_GUARD_S

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX's persistent compilation cache"
)

_SCRIPT = """
import json, os, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import keras
import numpy as np
import keras_gpushare as kg

rng = np.random.default_rng(0)
x = rng.normal(size=(96, 6)).astype("float32")
y = rng.normal(size=(96, 1)).astype("float32")

def member(units, seed, rate):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(units, activation="relu"), keras.layers.Dense(1)
    ])
    model.compile(keras.optimizers.Adam(rate), "mse")
    return model

def programs_after(units, seed):
    models = [member(units, seed + i, 10.0 ** -(2 + i)) for i in range(3)]
    pack = kg.ModelPack(models)
    pack.compile(optimizer=[m.optimizer for m in models], loss="mse")
    pack.fit(x, y, batch_size=32, epochs=2, validation_split=0.25, verbose=0)
    pack.evaluate(x, y, batch_size=32, verbose=0)
    return len(os.listdir(sys.argv[1]))

counts = [programs_after(8, 0), programs_after(8, 10), programs_after(12, 20)]
print(json.dumps(counts))
"""


def test_a_pack_of_the_same_signature_compiles_nothing_new(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax")
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first, same, wider = json.loads(result.stdout.strip().splitlines()[-1])
    assert first > 0  # the cache holds the first pack's programs
    # Other weights and learning rates: the same programs.
    assert same == first
    # Wider members: a new signature, compiled anew (the count above can tell).
    assert wider > same
