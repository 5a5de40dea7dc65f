"""The package's layout rules (the design document ARCHITECTURE.md: "Layout", "Target (turn 3)").

Three rules are the ecosystem's tools' (CONVENTIONS.md 16), run by `make lint` and `make
test`; the tests here plant offences in a copy of the package and see each tool report them:

(a) No import cycle: import-linter's `acyclic_siblings` contract in pyproject.toml. The
    modules and subpackages of each package import each other one way; lazy imports and
    imports under `if TYPE_CHECKING:` count (a type-only circle is still a circle).
(b) Dependencies point one way: import-linter's other contracts (`pack`, `placement` and
    `monitor` independent of each other, `tuner` and `autopack` above them, the command
    line above all, no engine reaching `pack/model.py`, the fused engine above its stacked
    losses and metrics, which import neither it nor each other, and `pack/model.py` above
    its backrooms: `_compiling` and `_member_access`, which import neither each other nor
    it, above `_loop`).
(c) Every name the package reads or calls on an engine is declared on the engine classes of
    `pack/engines/base.py`, for that kind of engine: mypy (`[tool.mypy]`), which knows the
    pack's engines by their types (`ModelPack._engines`, `_gradient_engines`,
    `_stepping_engines`, and the attributes `_tf_steps.TensorFlowSteps` declares).

One rule no tool states is checked here, on the parsed package, with its planted offence:

(d) The modules of `pack/` are private by name, except those ARCHITECTURE.md names
    (`model`, `planner`, `members`, `data`) and the packages `engines/` and `fusion/`.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_gpushare"

# (d): the modules of pack/ that keep a public name, and why.
PUBLIC_PACK_MODULES = {
    "__init__": "the package",
    "model": "ARCHITECTURE.md: the keras.Model subclass (and its saved files' module)",
    "planner": "ARCHITECTURE.md: groups members and chooses engines",
    "members": "ARCHITECTURE.md: member state",
    "data": "ARCHITECTURE.md: replicate / shard",
    "program": "the one entry of a search's executor (tuner/): open a program, its FLOPs",
    "engines": "ARCHITECTURE.md: the engine protocol and engines (a package)",
    "fusion": "ARCHITECTURE.md: converter, fused layers, vectorized optimizer (a package)",
}


def public_pack_modules(paths) -> list[str]:
    """The modules and packages directly in `keras_gpushare/pack/` with a public name that
    ARCHITECTURE.md does not name."""
    found = set()
    for path in paths:
        parts = path.split("/")
        if parts[:2] != ["keras_gpushare", "pack"] or len(parts) < 3:
            continue
        name = parts[2].removesuffix(".py")
        if not name.startswith("_") and name not in PUBLIC_PACK_MODULES:
            found.add("/".join(parts[:3]))
    return sorted(found)


def package_paths() -> list[str]:
    return [path.relative_to(ROOT).as_posix() for path in sorted(PACKAGE.rglob("*.py"))]


def package_copy(tmp_path: pathlib.Path, planted: dict[str, str]) -> pathlib.Path:
    """A copy of the package (with pyproject.toml and the command line's parser) under
    `tmp_path`, with `planted` (`{path under keras_gpushare/: code}`) added to it."""
    copy = tmp_path / "keras_gpushare"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path, code in planted.items():
        (copy / path).write_text(code)
    for name in ("pyproject.toml", "keras_gpushare_cli.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def run_tool(name: str, args: list[str], cwd: pathlib.Path) -> tuple[int, str]:
    """`name` (a tool of this interpreter's environment) run in `cwd` on the copy there."""
    tool = pathlib.Path(sys.executable).with_name(name)
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    result = subprocess.run(
        [str(tool), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    return result.returncode, result.stdout + result.stderr


def test_pack_modules_are_private_by_name():
    found = public_pack_modules(package_paths())
    assert not found, (
        "Give these a leading underscore, or name them in ARCHITECTURE.md and "
        "PUBLIC_PACK_MODULES:\n" + "\n".join(found)
    )


def test_planted_public_pack_modules_are_reported():
    paths = [
        *package_paths(),
        "keras_gpushare/pack/helpers.py",
        "keras_gpushare/pack/_private.py",
        "keras_gpushare/pack/schedules/__init__.py",
        "keras_gpushare/pack/fusion/public_inside_fusion.py",
        "keras_gpushare/placement/public.py",
    ]
    assert public_pack_modules(paths) == [
        "keras_gpushare/pack/helpers.py",
        "keras_gpushare/pack/schedules",
    ]


def test_the_tuner_contract_names_every_private_module_of_the_pack():
    """(b): the contract that keeps `tuner/` off the pack's private modules lists each one
    (import-linter's module expressions cannot say "a leading underscore")."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c.get("source_modules") == ["keras_gpushare.tuner"]]
    forbidden = set(contract["forbidden_modules"])
    private = {
        "keras_gpushare.pack." + path.name.removesuffix(".py")
        for path in (PACKAGE / "pack").iterdir()
        if path.name.startswith("_") and not path.name.startswith("__")
    }
    assert private, "no private module found in pack/"
    assert private <= forbidden, sorted(private - forbidden)


def test_planted_cycles_and_imports_against_the_direction_are_reported(tmp_path):
    """(a), (b): import-linter breaks each contract on a copy of the package with offences
    planted (a lazy import, one under `TYPE_CHECKING`, and one through a module of no part
    count)."""
    summary = (PACKAGE / "pack" / "_member_access" / "_summary.py").read_text()
    stacked_loss = (PACKAGE / "pack" / "engines" / "_stacked_loss.py").read_text()
    copy = package_copy(
        tmp_path,
        {
            "pack/_planted.py": "def lazy():\n    from keras_gpushare import callbacks\n",
            "placement/_planted.py": "from keras_gpushare.tuner import oracle\n",
            "tuner/_planted.py": "def f():\n    from keras_gpushare.pack._loop import _logs\n",
            "pack/engines/_planted.py": (
                "def f():\n    from keras_gpushare.pack._member_access import _summary\n"
            ),
            "pack/engines/_stacked_loss.py": stacked_loss + "\nfrom . import _stacked_metric\n",
            "pack/_loop/_planted.py": "def f():\n    from keras_gpushare.pack import _compiling\n",
            "pack/_member_access/_planted.py": "from keras_gpushare.pack import _compiling\n",
            "pack/_member_access/_summary.py": (
                summary + "\nfrom keras_gpushare.pack import model\n"
            ),
            "placement/_cycle_a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from keras_gpushare.placement import _cycle_b\n"
            ),
            "placement/_cycle_b.py": "def f():\n    from . import _cycle_a\n",
        },
    )
    code, out = run_tool("lint-imports", ["--no-cache"], copy)
    out = " ".join(out.split())
    assert code == 1, out
    assert "Contracts: 0 kept, 7 broken." in out
    # The pack reaches the monitor through keras_gpushare.callbacks.
    assert "keras_gpushare.pack._planted -> keras_gpushare.callbacks" in out
    assert "keras_gpushare.placement._planted -> keras_gpushare.tuner.oracle" in out
    assert (
        "keras_gpushare.pack.engines._planted -> keras_gpushare.pack._member_access._summary" in out
    )
    assert (
        "keras_gpushare.pack.engines._stacked_loss -> keras_gpushare.pack.engines._stacked_metric"
        in out
    )
    assert "keras_gpushare.pack._loop._planted -> keras_gpushare.pack._compiling" in out
    assert "keras_gpushare.pack._member_access._planted -> keras_gpushare.pack._compiling" in out
    assert "keras_gpushare.tuner._planted -> keras_gpushare.pack._loop._logs" in out
    assert "No cycles are allowed in keras_gpushare.placement." in out
    assert "._cycle_b -> ._cycle_a (1 import)" in out
    assert "No cycles are allowed in keras_gpushare.pack." in out  # _summary <-> model


def test_planted_undeclared_engine_names_are_reported(tmp_path):
    """(c): mypy, on a copy of the package with a module that uses engines as the pack
    does, reports each name the engine classes do not declare for that kind of engine, and
    knows the pack's engines by their types (the check is not passing for want of them)."""
    planted = (
        "from keras_gpushare.pack.engines.base import GradientEngine\n"
        "from keras_gpushare.pack.model import ModelPack\n"
        "def step(pack: ModelPack, data: object, status: object) -> None:\n"
        "    for engine in pack._engines:\n"
        "        engine.call(data)\n"  # declared on Engine
        "        engine.updates_itself\n"  # declared nowhere
        "    for g in pack._gradient_engines:\n"
        "        g.loss\n"  # GradientEngine's
        "        g.train(data, status)\n"  # SteppingEngine's, not a gradient engine's
        "    pack._stepping_engines[0].loss\n"  # GradientEngine's, not a stepping engine's
        "    reveal_type(pack._engines)\n"
        "def helper(others: list[GradientEngine]) -> object:\n"
        "    return [o.plan for o in others]\n"
    )
    copy = package_copy(tmp_path, {"pack/_planted.py": planted})
    args = ["keras_gpushare", "--cache-dir", str(tmp_path / ".mypy_cache")]
    code, out = run_tool("mypy", args, copy)
    found = [line for line in out.splitlines() if line.startswith("keras_gpushare/pack/_planted")]
    assert code == 1, out
    assert found == [
        'keras_gpushare/pack/_planted.py:6: error: "Engine" has no attribute "updates_itself"'
        "  [attr-defined]",
        'keras_gpushare/pack/_planted.py:9: error: "GradientEngine" has no attribute "train"'
        "  [attr-defined]",
        'keras_gpushare/pack/_planted.py:10: error: "SteppingEngine" has no attribute "loss"'
        "  [attr-defined]",
        "keras_gpushare/pack/_planted.py:11: note: Revealed type is "
        '"keras_gpushare.pack._loop._fit_args.Items[keras_gpushare.pack.engines.base.Engine]"',
        'keras_gpushare/pack/_planted.py:13: error: "GradientEngine" has no attribute "plan"'
        "  [attr-defined]",
    ], out
