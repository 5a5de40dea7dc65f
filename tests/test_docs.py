"""The documentation site builds with `mkdocs build --strict`: no broken link, no missing page.

The API reference is generated from the docstrings by mkdocstrings, so a public name that
moves or a docstring that griffe cannot read fails here too.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
from hang_guard import HANG_GUARD_S

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs or mkdocstrings is not installed (pip install -e '.[test]' installs both)",
)
def test_docs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    for page in ("index.html", "api/index.html", "autopack/index.html", "how-it-works/index.html"):
        assert (tmp_path / page).is_file(), page
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("ModelPack", "find_pack_size", "UtilizationLogger", "PlacedModel"):
        assert re.search(rf'id="keras_gpushare\.([\w.]*\.)?{name}"', api), name
