"""Crash-safe writes of the tuner's state files: a file is either the old one or the new one."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from keras_gpushare import _upstream


def _is_local(path: str) -> bool:
    return "://" not in str(path)


def write_json(path: str, obj: Any) -> str:
    """Writes `obj` as JSON to `path` atomically (temporary file, fsync, rename).

    Paths on remote file systems (`gs://...`) go through KerasTuner's own writer.
    """
    text = json.dumps(obj)
    if not _is_local(path):
        return _upstream.kt_save_json(path, obj)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return text


def save_weights(model: Any, path: str) -> None:
    """Saves `model`'s weights to `path` (a `.weights.h5` file) atomically."""
    if not _is_local(path):
        model.save_weights(path)
        return
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{name}")
    try:
        model.save_weights(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
