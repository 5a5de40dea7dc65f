"""`keras-gpushare autopack` helpers: load `MODULE:BUILD_FN`, parse a shape, make random data."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

_EXAMPLE = "e.g. mypkg.models:build_model or path/to/models.py:build_model"


def load_builder(spec: str) -> Callable[..., Any]:
    """Returns the function `spec` (`"module.name:function"` or `"file.py:function"`) names.

    The current directory is importable, as for `python -m`.

    Raises:
        ValueError: the spec is malformed, the module cannot be imported, or it has no such
            callable.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise ValueError(
            f"Invalid value for MODULE:BUILD_FN: got {spec!r}. Pass a module and a function "
            f"separated by a colon, {_EXAMPLE}."
        )
    if module_name.endswith(".py"):
        module = _import_file(module_name, spec)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"Invalid value for MODULE:BUILD_FN: got {spec!r}, but module {module_name!r} "
                f"cannot be imported ({type(e).__name__}: {e}). Pass an importable module "
                f"(run from the folder that holds it) or a path to a .py file, {_EXAMPLE}."
            ) from None
    build_fn = getattr(module, attr, None)
    if not callable(build_fn):
        found = sorted(
            name
            for name, value in vars(module).items()
            if inspect.isfunction(value) and not name.startswith("_")
        )
        raise ValueError(
            f"Invalid value for MODULE:BUILD_FN: got {spec!r}, but {module_name} has no "
            f"function {attr!r}. Functions it defines: {', '.join(found) or 'none'}."
        )
    return build_fn


def _import_file(path: str, spec_text: str) -> Any:
    if not os.path.isfile(path):
        raise ValueError(
            f"Invalid value for MODULE:BUILD_FN: got {spec_text!r}, but {path} is not a file."
        )
    name = "_keras_gpushare_builder_" + re.sub(r"\W", "_", os.path.basename(path)[:-3])
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(
            f"Invalid value for MODULE:BUILD_FN: got {spec_text!r}, but {path} cannot be "
            "imported as a Python module."
        )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_shape(text: str) -> tuple[int, ...]:
    """`"28,28,1"` (or `"28x28x1"`) as `(28, 28, 1)`.

    Raises:
        ValueError: the text is not positive integers separated by commas.
    """
    parts = [p.strip() for p in re.split(r"[,x]", text.strip().strip("()[]"))]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"Invalid value for --input-shape: got {text!r}. Pass one sample's shape as "
            "positive integers separated by commas, e.g. 10 or 28,28,1."
        )
    return tuple(int(p) for p in parts)


def random_data(
    build_fn: Callable[..., Any], shape: tuple[int, ...], samples: int, loss: str
) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs of `shape` and targets that suit the model's output and `loss`.

    Builds one model to read its input and output shapes, then clears the session.

    Raises:
        ValueError: the model's input shape does not match `shape`.
    """
    import keras

    model = build_fn(0) if inspect.signature(build_fn).parameters else build_fn()
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"Invalid value for MODULE:BUILD_FN: it returned {type(model).__name__}, "
            "expected a keras.Model."
        )
    expected = _known_input_shape(model)
    if expected is not None and (
        len(expected) != len(shape)
        or any(e is not None and e != s for e, s in zip(expected, shape))
    ):
        wanted = ",".join("?" if e is None else str(e) for e in expected)
        raise ValueError(
            f"Invalid value for --input-shape: got {','.join(map(str, shape))}, but the model "
            f"takes inputs of shape {wanted}. Pass --input-shape {wanted}."
        )
    if not model.built:
        model.build((None, *shape))
    output_shape = tuple(model.compute_output_shape((samples, *shape)))
    keras.backend.clear_session()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, *shape)).astype("float32")
    return x, _targets(rng, output_shape, loss)


def _known_input_shape(model: Any) -> tuple | None:
    try:
        shape = model.input_shape
    except (AttributeError, ValueError):
        return None
    if not isinstance(shape, tuple) or (shape and isinstance(shape[0], (tuple, list))):
        return None  # several inputs: not a single --input-shape
    return tuple(shape[1:])


def _targets(rng: np.random.Generator, output_shape: tuple, loss: str) -> np.ndarray:
    loss = loss.lower()
    units = int(output_shape[-1]) if len(output_shape) > 1 else 1
    if "sparse_categorical" in loss:
        return rng.integers(0, max(units, 2), size=output_shape[:-1]).astype("int32")
    if "categorical" in loss:
        ids = rng.integers(0, units, size=output_shape[:-1])
        return np.eye(units, dtype="float32")[ids]
    if "binary" in loss or "hinge" in loss:
        return rng.integers(0, 2, size=output_shape).astype("float32")
    return rng.normal(size=output_shape).astype("float32")
