"""The backend seam: `pack/_backend.py` is the one module of `pack/` that asks Keras which
backend runs, and its answers on the running backend match what Keras itself does there.

The structure rule is checked on the parsed package (and shown to report a planted read);
the answers are checked against Keras's own trainer and plain `fit`, not against a table.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
from hang_guard import HANG_GUARD_S
from pack_builders import mlp

import keras_gpushare as kg
from keras_gpushare.pack._backend import BACKEND, policy_for

PACK = pathlib.Path(kg.__file__).resolve().parent / "pack"
SEAM = PACK / "_backend.py"
_BACKEND_READS = {"keras.backend.backend", "keras.config.backend"}


def backend_reads(source: str) -> list[int]:
    """The lines of `source` that call `keras.backend.backend()` or `keras.config.backend()`,
    under whatever names the module imports them."""
    tree = ast.parse(source)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts = []
        func = node.func
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name):
            continue
        head = aliases.get(func.id) or func.id
        if ".".join([head, *reversed(parts)]) in _BACKEND_READS:
            lines.append(node.lineno)
    return lines


# Structure ----------------------------------------------------------------------------


def test_only_the_seam_reads_the_backend():
    offences = {
        path.relative_to(PACK).as_posix(): lines
        for path in sorted(PACK.rglob("*.py"))
        if path != SEAM and (lines := backend_reads(path.read_text(encoding="utf-8")))
    }
    assert not offences, f"ask `pack._backend.BACKEND` instead (module: lines): {offences}"


def test_the_seam_itself_is_seen_reading_the_backend():
    assert backend_reads(SEAM.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "source",
    [
        "import keras\nif keras.backend.backend() == 'jax':\n    pass\n",
        "import keras as k\nname = k.config.backend()\n",
        "from keras import backend as K\nname = K.backend()\n",
        "from keras.config import backend\nname = backend()\n",
    ],
)
def test_a_planted_read_is_reported(source):
    assert backend_reads(source) == [2]


def test_other_keras_calls_and_the_policy_are_not_reads():
    source = "import keras\nkeras.backend.floatx()\nBACKEND.name\nkeras.config.floatx()\n"
    assert backend_reads(source) == []


# The policy on the running backend ----------------------------------------------------


def test_the_policy_is_chosen_once_for_the_running_backend():
    assert BACKEND.name == keras.backend.backend()
    assert policy_for(keras.backend.backend()) == BACKEND


def test_answers_match_the_trainer_keras_mixed_in():
    assert BACKEND.distribute_strategies == hasattr(keras.Model, "distribute_strategy")
    assert BACKEND.stateless_steps == hasattr(keras.Model, "jax_state_sync")
    own = [c for c in kg.ModelPack.__mro__ if c.__module__.endswith("._tf_steps")]
    assert bool(own) == BACKEND.own_steps


def _classifier(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def _fit(model: keras.Model, labels: np.ndarray, **compile_args) -> None:
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", **compile_args)
    model.fit(np.zeros((8, 4), "float32"), labels, batch_size=4, epochs=1, verbose=0)


def _refuses(model: keras.Model, labels: np.ndarray, **compile_args) -> bool:
    """Whether `_fit` raises (any error: each backend raises its own)."""
    try:
        _fit(model, labels, **compile_args)
    except Exception:
        return True
    return False


def test_one_batch_per_call_where_plain_keras_refuses_more():
    labels = np.zeros((8,), "int32")
    refuses = _refuses(_classifier(0), labels, steps_per_execution=2)
    assert BACKEND.one_batch_per_call == refuses


def test_out_of_range_labels_are_refused_where_plain_fit_refuses_them():
    labels = np.full((8,), 5, "int32")  # three classes
    plain = _refuses(_classifier(0), labels)
    pack = kg.ModelPack([_classifier(0), _classifier(1)])
    if BACKEND.label_ranges_checked:
        assert plain
        with pytest.raises(ValueError, match="Invalid labels for member 0"):
            _fit(pack, labels)
    else:
        assert _refuses(pack, labels) == plain


def test_the_graph_engine_where_the_backend_has_it():
    members = [mlp(4, seed=s) for s in range(2)]
    if BACKEND.graph_engine:
        assert kg.ModelPack(members, fuse=False).engine == "graph"
    else:
        match = (
            f"Member 0 \\(and members 1\\) cannot fuse: fuse=False. On the '{BACKEND.name}' "
            "backend every member must fuse"
        )
        with pytest.raises(ValueError, match=match):
            kg.ModelPack(members, fuse=False)


class Doubling(keras.layers.Layer):
    def call(self, x):
        return x * 2


@pytest.mark.skipif(BACKEND.graph_engine, reason="the graph engine trains such members")
def test_a_member_that_cannot_fuse_is_named_with_its_layer():
    members = [mlp(4, seed=0), mlp(4, seed=1)]
    keras.utils.set_random_seed(2)
    custom = keras.Sequential(
        [keras.Input((10,)), keras.layers.Dense(4), Doubling(), keras.layers.Dense(1)]
    )
    with pytest.raises(ValueError) as raised:
        kg.ModelPack([*members, custom])
    first_line = str(raised.value).splitlines()[0]
    assert first_line.startswith("Member 2 cannot fuse: layer `doubling` (Doubling): ")
    assert "register_fused_layer" in first_line


@pytest.mark.skipif(BACKEND.name == "tensorflow", reason="TensorFlow is the backend here")
def test_tensorflow_is_not_imported_on_other_backends():
    code = "import sys, keras_gpushare; print('tensorflow' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, "KERAS_BACKEND": BACKEND.name},
        check=True,
    )
    assert result.stdout.strip() == "False"
