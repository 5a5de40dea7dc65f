"""Every `Example:` in the package's docstrings runs as written, on a CPU.

The examples are found by walking `keras_gpushare`'s modules: each public class, function,
method and property defined there whose own docstring has an `Example:` (or `Examples:`)
section is one test. The section's ```python blocks run in this process, one after the other
in one namespace; a `print(...)  # comment` whose comment is a literal value (a shape, a list
of numbers, True or False) must print it. A section with no ```python block fails, so no
example is silently left out.
"""

import importlib
import inspect
import pathlib
import pkgutil
import re
import subprocess
import sys

import keras
import pytest
from hang_guard import HANG_GUARD_S

import keras_gpushare

_HEADING = re.compile(r"^Examples?:\s*$", re.M)
_NEXT_SECTION = re.compile(r"^[A-Z][A-Za-z ]*:\s*$", re.M)
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_PRINTED = re.compile(r"^\s*print\(.*\)\s+# (.+)$", re.M)
_LITERAL = re.compile(r"(?:[\d\s(),.\[\]-]|True|False)+")

# Examples that must start a process of their own, and why.
FRESH_PROCESS = {
    "keras_gpushare.devices.share_gpu": "it configures TensorFlow's devices, which a process "
    "can do only before it uses them (this one has: tests/conftest.py carves the CPU)",
}
# The modules whose names need Keras on TensorFlow: the package's own list.
TENSORFLOW_ONLY = tuple(set(keras_gpushare._TENSORFLOW_ONLY.values()))


def _documented(obj):
    """`obj` and its own public methods and properties: `(name suffix, docstring)` pairs."""
    yield "", obj.__doc__
    if inspect.isclass(obj):
        for name, member in vars(obj).items():
            if name.startswith("_"):
                continue
            member = member.fget if isinstance(member, property) else member
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if inspect.isfunction(member):
                yield f".{name}", member.__doc__


def _examples():
    """`{qualified name: docstring}` for every public object with an `Example:` section."""
    found = {}
    for info in pkgutil.walk_packages(keras_gpushare.__path__, "keras_gpushare."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            defined_here = getattr(obj, "__module__", None) == module.__name__
            if name.startswith("_") or not defined_here:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            for suffix, doc in _documented(obj):
                if doc and _HEADING.search(inspect.cleandoc(doc)):
                    found[f"{module.__name__}.{name}{suffix}"] = inspect.cleandoc(doc)
    return found


EXAMPLES = _examples()


def example_code(doc):
    """The code of the `Example:` section of `doc`: its ```python blocks, joined."""
    section = doc[_HEADING.search(doc).end() :]
    blocks = list(_BLOCK.finditer(section))
    headings = (m.start() for m in _NEXT_SECTION.finditer(section))
    end = next((h for h in headings if not any(b.start() <= h < b.end() for b in blocks)), None)
    return "\n".join(b.group(1) for b in blocks if end is None or b.start() < end)


def test_every_example_in_the_source_is_found():
    """The walk finds as many examples as the source has `Example:` headings: none is in a
    private or nested object the walk cannot reach."""
    package = pathlib.Path(keras_gpushare.__file__).parent
    headings = sum(
        len(re.findall(r"^\s*Examples?:\s*$", path.read_text(), re.M))
        for path in package.rglob("*.py")
    )
    assert len(EXAMPLES) == headings, sorted(EXAMPLES)
    assert set(FRESH_PROCESS) <= set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example_runs(name, tmp_path, monkeypatch, capsys):
    if name.startswith(TENSORFLOW_ONLY) and keras.backend.backend() != "tensorflow":
        pytest.skip("a TensorFlow-only name")
    code = example_code(EXAMPLES[name])
    assert code.strip(), f"{name}: its `Example:` section has no ```python block to run."
    monkeypatch.chdir(tmp_path)  # anything the example writes stays out of the checkout
    if name in FRESH_PROCESS:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        printed = result.stdout
    else:
        exec(compile(code, f"<{name} example>", "exec"), {"__name__": "__example__"})
        printed = capsys.readouterr().out
    for comment in _PRINTED.findall(code):
        if _LITERAL.fullmatch(comment.strip()):
            assert " ".join(comment.split()) in " ".join(printed.split()), (
                f"{name}: expected {comment!r} printed, got:\n{printed[-2000:]}"
            )
