"""No private name of Keras, KerasTuner or TensorFlow outside keras_gpushare/_upstream.py.

The package is parsed, not imported. A private name (one underscore, not a dunder) read as
an attribute or passed as a literal to `getattr`/`hasattr`/`setattr`/`delattr` is judged by
its receiver: it is the package's own when the receiver is

- a module of the package (`_upstream.x`, `_slots.x`);
- `self` or `cls` in a method of a package class, the class itself, an object annotated with
  a package class (an argument, a variable, or an attribute annotated or assigned from an
  annotated argument), or one a package class's constructor returned, and the package
  defines the name on that class or on a package class it derives from (in its body, by
  `self._x = ...`, or by `setattr(self, "_x", ...)`);
- `super()` in a method of a package class, when a package class it derives from defines the
  name.

Any other receiver (a Keras object, an untyped one) makes the name upstream's, even when some
package class defines an attribute of that name. Every upstream one belongs in `_upstream`,
behind an accessor that tests/test_upstream.py checks against the installed releases; so does
any import of `keras.src`, `keras_tuner.src` or `tensorflow.python` (by `import` or by
`importlib.import_module("...")`). The standard library's few are listed in
`STANDARD_LIBRARY`.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_gpushare"
UPSTREAM = "keras_gpushare/_upstream.py"
UPSTREAM_MODULES = ("keras.src", "keras_tuner.src", "tensorflow.python")
ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}
IMPORT_FUNCTIONS = {"import_module", "__import__"}
MODULE, SUPER = "<a module of the package>", "<super()>"

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


def _name(node):
    return getattr(node, "attr", getattr(node, "id", None))


def _module_name(path):
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node):
    """The names and attributes an assignment binds (tuples unpacked)."""
    todo = list(node.targets) if isinstance(node, ast.Assign) else [node.target]
    while todo:
        target = todo.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            todo.extend(target.elts)
        else:
            yield target


def _members(cls):
    """The statements of a class's body, `if`/`try` blocks included (not nested scopes)."""
    todo = list(cls.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", []))
        else:
            yield node


class Package:
    """The package's classes (the names each defines, its bases, the classes of its
    attributes) and modules, from `sources` (`{path: code}`)."""

    def __init__(self, sources):
        self.trees = {path: ast.parse(code, path) for path, code in sources.items()}
        self.modules = {_module_name(path) for path in sources}
        self.defines, self.bases, self.attributes = {}, {}, {}
        classes = [
            n for t in self.trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)
        ]
        for node in classes:
            self.bases.setdefault(node.name, []).extend(_name(base) for base in node.bases)
            self.defines.setdefault(node.name, set())
            self.attributes.setdefault(node.name, {})
        for node in classes:
            self._read_class(node)

    def annotated(self, annotation):
        """The package class `annotation` names (`C`, `"C"`, `m.C`, `C | None`)."""
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            found = {self.annotated(annotation.left), self.annotated(annotation.right)} - {None}
            return found.pop() if len(found) == 1 else None
        return _name(annotation) if _name(annotation) in self.defines else None

    def _read_class(self, cls):
        names, attributes = self.defines[cls.name], self.attributes[cls.name]
        for node in _members(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                names.update(_name(t) for t in _targets(node) if isinstance(t, ast.Name))
                if isinstance(node, ast.AnnAssign) and self.annotated(node.annotation):
                    attributes[_name(node.target)] = self.annotated(node.annotation)
        for method in _members(cls):
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arguments = {
                a.arg: self.annotated(a.annotation) for a in method.args.args if a.annotation
            }
            for node in ast.walk(method):
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for target in _targets(node):
                        if isinstance(target, ast.Attribute) and _name(target.value) in (
                            "self",
                            "cls",
                        ):
                            names.add(target.attr)
                            if isinstance(node, ast.AnnAssign):
                                found = self.annotated(node.annotation)
                            else:
                                found = arguments.get(_name(node.value))
                            if found:
                                attributes[target.attr] = found
                elif (
                    isinstance(node, ast.Call)
                    and _name(node.func) in ("setattr", "__setattr__")
                    and len(node.args) == 3
                    and _name(node.args[0]) == "self"
                    and _literal(node.args[1])
                ):
                    names.add(_literal(node.args[1]))

    def mro(self, cls):
        """`cls` and the package classes it derives from."""
        order, todo = [], [cls]
        while todo:
            name = todo.pop(0)
            if name in self.defines and name not in order:
                order.append(name)
                todo.extend(self.bases[name])
        return order

    def defines_on(self, classes, name):
        return any(name in self.defines[c] for c in classes)

    def attribute(self, cls, name):
        return next(
            (self.attributes[c][name] for c in self.mro(cls) if name in self.attributes[c]), None
        )


class _Reader(ast.NodeVisitor):
    """`(line, name)` of each private name `tree` reads on what is not the package's own."""

    def __init__(self, package, path):
        self.package, self.path, self.module = package, path, _module_name(path)
        self.scopes = [{}]  # name -> a package class, or MODULE
        self.classes = []
        self.found = []

    def bind(self, name, value):
        if value is not None:
            self.scopes[-1][name] = value

    def visit_Import(self, node):
        for alias in node.names:
            if _is_upstream_module(alias.name):
                self.found.append((node.lineno, alias.name))
            elif alias.name.split(".")[0] == "keras_gpushare":
                self.bind(alias.asname or "keras_gpushare", MODULE)

    def visit_ImportFrom(self, node):
        if node.module and not node.level and _is_upstream_module(node.module):
            self.found.append((node.lineno, node.module))
        base = node.module or ""
        if node.level:
            parts = self.module.split(".")
            if not self.path.endswith("__init__.py"):
                parts = parts[:-1]
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
            if f"{base}.{alias.name}" in self.package.modules:
                self.bind(alias.asname or alias.name, MODULE)

    def visit_ClassDef(self, node):
        for part in node.bases + node.decorator_list:
            self.visit(part)
        self.classes.append(node.name)
        for part in node.body:
            self.visit(part)
        self.classes.pop()

    def visit_FunctionDef(self, node):
        for part in node.decorator_list + node.args.defaults:
            self.visit(part)
        self.scopes.append({})
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        for i, arg in enumerate(arguments):
            if arg.annotation is not None:
                self.bind(arg.arg, self.package.annotated(arg.annotation))
            elif i == 0 and self.classes and arg.arg in ("self", "cls"):
                self.bind(arg.arg, self.classes[-1])
        for part in node.body:
            self.visit(part)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        self.generic_visit(node)
        for target in node.targets:
            if isinstance(target, ast.Name):
                self.scopes[-1].pop(target.id, None)
                self.bind(target.id, self.receiver(node.value))

    def visit_AnnAssign(self, node):
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            self.bind(node.target.id, self.package.annotated(node.annotation))

    def receiver(self, node):
        """The package class (or MODULE, SUPER) `node` is known to be, or None."""
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return node.id if node.id in self.package.defines else None
        if isinstance(node, ast.Attribute):
            owner = self.receiver(node.value)
            if owner == MODULE:
                return node.attr if node.attr in self.package.defines else MODULE
            return (
                self.package.attribute(owner, node.attr) if owner in self.package.defines else None
            )
        if isinstance(node, ast.Call):
            if _name(node.func) == "super" and self.classes:
                return SUPER
            owner = self.receiver(node.func)
            return owner if owner in self.package.defines else None
        return None

    def check(self, node, receiver, name):
        if not _is_private(name) or name in STANDARD_LIBRARY:
            return
        owner = self.receiver(receiver)
        if owner == MODULE:
            return
        if owner == SUPER:
            classes = self.package.mro(self.classes[-1])[1:]
        else:
            classes = self.package.mro(owner) if owner in self.package.defines else []
        if not self.package.defines_on(classes, name):
            self.found.append((node.lineno, name))

    def visit_Attribute(self, node):
        if not isinstance(node.ctx, ast.Store):
            self.check(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node):
        name = _name(node.func)
        if name in ATTRIBUTE_FUNCTIONS and len(node.args) > 1 and _literal(node.args[1]):
            if name != "setattr" or self.receiver(node.args[0]) is None:
                self.check(node, node.args[0], _literal(node.args[1]))
        elif (
            name in IMPORT_FUNCTIONS
            and node.args
            and _is_upstream_module(_literal(node.args[0]) or "")
        ):
            self.found.append((node.lineno, _literal(node.args[0])))
        self.generic_visit(node)


def offenders(sources):
    """`(path, line, name)` of each private upstream name in `sources` (`{path: code}`)
    outside `_upstream.py`."""
    package = Package(sources)
    found = []
    for path, tree in package.trees.items():
        if path != UPSTREAM:
            reader = _Reader(package, path)
            reader.visit(tree)
            found.extend((path, line, name) for line, name in reader.found)
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


def test_a_name_the_package_defines_is_upstream_s_on_an_upstream_receiver():
    """The receiver decides: `_learning_rate` on a Keras optimizer is Keras's; so are
    `_members` on an untyped object and `_symbolic_build` on a Keras model or through
    `super()`, though `ModelPack` defines both (which once let any module read them on
    anything)."""
    sources = package_sources()
    planted = "keras_gpushare/pack/_planted.py"
    sources[planted] = (
        "import keras\n"
        "from keras_gpushare.pack.model import ModelPack\n"
        "def read(optimizer: keras.optimizers.Optimizer, pack, model: keras.Model):\n"
        "    return optimizer._learning_rate, pack._members, model._symbolic_build\n"
        "class Steps(keras.Model):\n"
        "    def _symbolic_build(self, data_batch):\n"
        "        super()._symbolic_build(data_batch=data_batch)\n"
        "        return self._tracker\n"
        "def own(pack: ModelPack):\n"
        "    return pack._members, ModelPack(members=[])._status\n"
    )
    assert [(line, name) for p, line, name in offenders(sources) if p == planted] == [
        (4, "_learning_rate"),
        (4, "_members"),
        (4, "_symbolic_build"),
        (7, "_symbolic_build"),
        (8, "_tracker"),
    ]


def test_the_package_own_private_names_are_not_flagged():
    code = (
        "from keras_gpushare import _box_helpers\n"
        "from typing import Protocol\n"
        "class Base:\n"
        "    def _shared(self):\n"
        "        return _box_helpers._helper()\n"
        "class Box(Base):\n"
        "    _count = 0\n"
        "    if True:\n"
        "        def _declared(self) -> None: ...\n"
        "    def __init__(self, parent: 'Box | None'):\n"
        "        self._size, self._step = 1, 2\n"
        "        self._parent = parent\n"
        "        object.__setattr__(self, '_lock', None)\n"
        "    def _grow(self):\n"
        "        super()._shared()\n"
        "        return self._step, self._lock, self._parent._size, self._declared()\n"
        "    @classmethod\n"
        "    def make(cls):\n"
        "        return cls._count, Box._count\n"
        "class View(Protocol):\n"
        "    _size: int\n"
        "def use(box: Box, view: View):\n"
        "    made = Box(None)\n"
        "    held: Box = box\n"
        "    return box._grow(), getattr(box, '_lock'), view._size, made._size, held._shared()\n"
    )
    sources = {"keras_gpushare/box.py": code, "keras_gpushare/_box_helpers.py": ""}
    assert offenders(sources) == []


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
