"""No private name of Keras, KerasTuner or TensorFlow outside keras_gpushare/_upstream.py.

The package is parsed, not imported. A private name (one underscore, not a dunder) read as
an attribute or passed as a literal to `getattr`/`hasattr`/`setattr`/`delattr`, and any
import of `keras.src`, `keras_tuner.src` or `tensorflow.python` (by `import` or by
`importlib.import_module("...")`), is upstream's unless the package defines the name itself:
as a function, class, argument, variable or import alias, or by assigning the attribute
(`self._x = ...`, `setattr(self, "_x", ...)`, or on another object, as the tuner's
`tuner._init_call = ...`). Every upstream one belongs in `_upstream`, behind an accessor that
tests/test_upstream.py checks against the installed releases; the standard library's few
are listed in `STANDARD_LIBRARY`.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_gpushare"
UPSTREAM = "keras_gpushare/_upstream.py"
UPSTREAM_MODULES = ("keras.src", "keras_tuner.src", "tensorflow.python")
ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}
IMPORT_FUNCTIONS = {"import_module", "__import__"}

# Private names of the standard library the package uses, and why.
STANDARD_LIBRARY = {
    "_SubParsersAction": "argparse._SubParsersAction: what `add_subparsers` returns (hints)",
    "_getframe": "sys._getframe: the frame that drives training, which the sampler watches",
    "_current_frames": "sys._current_frames: whether that frame is still on its thread's stack",
    "_exit": "os._exit: a tuner worker whose chief is gone exits at once, from its watchdog",
}


def _is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_upstream_module(module):
    return any(module == m or module.startswith(m + ".") for m in UPSTREAM_MODULES)


def _literal(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _sets_own_attribute(call):
    """`setattr(self, "_x", v)` or `object.__setattr__(self, "_x", v)`: the name `_x`."""
    func, args = call.func, call.args
    setter = (isinstance(func, ast.Name) and func.id == "setattr") or (
        isinstance(func, ast.Attribute) and func.attr == "__setattr__"
    )
    if setter and len(args) == 3 and isinstance(args[0], ast.Name) and args[0].id == "self":
        return _literal(args[1])
    return None


def defined_names(trees):
    """Every name the package defines, in any of the parsed modules."""
    names = set()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif path == UPSTREAM:
                continue  # `_upstream` assigns upstream's attributes
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and _sets_own_attribute(node):
                names.add(_sets_own_attribute(node))
    return names


def private_uses(tree):
    """(line, name) of every private attribute name and upstream private module in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            yield node.lineno, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_FUNCTIONS
            and len(node.args) > 1
            and _literal(node.args[1])
            and not _sets_own_attribute(node)
        ):
            yield node.lineno, _literal(node.args[1])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in IMPORT_FUNCTIONS
            and node.args
            and _literal(node.args[0])
        ):
            yield node.lineno, _literal(node.args[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def offenders(sources):
    """`file:line: name` of each private upstream name in `sources` ({path: code}) outside
    `_upstream.py`."""
    trees = {path: ast.parse(code, path) for path, code in sources.items()}
    own = defined_names(trees) | set(STANDARD_LIBRARY)
    found = []
    for path, tree in trees.items():
        if path == UPSTREAM:
            continue
        for line, name in private_uses(tree):
            if _is_upstream_module(name) or (_is_private(name) and name not in own):
                found.append((path, line, name))
    return sorted(set(found))


def package_sources():
    return {
        path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_no_private_upstream_name_outside_upstream():
    found = [f"{path}:{line}: {name}" for path, line, name in offenders(package_sources())]
    assert not found, "Route these through keras_gpushare/_upstream.py:\n" + "\n".join(found)


def test_the_check_catches_private_reads_and_upstream_imports():
    sources = package_sources()
    planted = "keras_gpushare/pack/fusion/_planted.py"
    sources[planted] = (
        "def read(model, layer):\n"
        "    from keras.src.utils import io_utils\n"
        "    import tensorflow.python.ops as ops\n"
        "    getattr(layer, '_tracker')\n"
        "    importlib.import_module('keras_tuner.src.engine.oracle')\n"
        "    return model._nodes_by_depth, io_utils, ops\n"
    )
    assert [(line, name) for p, line, name in offenders(sources) if p == planted] == [
        (2, "keras.src.utils"),
        (3, "tensorflow.python.ops"),
        (4, "_tracker"),
        (5, "keras_tuner.src.engine.oracle"),
        (6, "_nodes_by_depth"),
    ]
    sources[UPSTREAM] += "\n\ndef _planted(model):\n    return model._tracker\n"
    assert not [f for f in offenders(sources) if f[0] == UPSTREAM]


def test_the_package_own_private_names_are_not_flagged():
    code = (
        "class Box:\n"
        "    def __init__(self):\n"
        "        self._size = 1\n"
        "        object.__setattr__(self, '_lock', None)\n"
        "    def _grow(self):\n"
        "        return self._size, self._lock, self.__class__\n"
        "def use(box):\n"
        "    return box._size, box._grow(), getattr(box, '_lock')\n"
    )
    assert offenders({"keras_gpushare/box.py": code}) == []


def unused_accessors(sources):
    """The public functions of `_upstream.py` that no other module of `sources` reads as
    `_upstream.<name>` (an accessor only its test calls is dead code)."""
    trees = {path: ast.parse(code, path) for path, code in sources.items()}
    accessors = {
        node.name
        for node in trees[UPSTREAM].body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }
    used = {
        node.attr
        for path, tree in trees.items()
        if path != UPSTREAM
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "_upstream"
    }
    return sorted(accessors - used)


def test_every_accessor_is_used_by_the_package():
    assert unused_accessors(package_sources()) == []


def test_an_accessor_no_module_reads_is_reported():
    sources = package_sources()
    sources[UPSTREAM] += "\n\ndef planted_accessor(model):\n    return model._tracker\n"
    assert unused_accessors(sources) == ["planted_accessor"]
