"""The differential harness: each member trained alone with plain Keras, then in a pack.

A `Case` says how to build member `i` (seeded, so members start from different weights),
how to compile it, and how to train it (`fit` arguments and callbacks, or a whole
procedure). The `Runner` builds the members, makes a twin of each with identical initial
weights, trains every twin alone with plain `compile` + `fit`, trains the members in a
`ModelPack` compiled with the same arguments, then evaluates and predicts with both.
The resulting `Run` holds everything the tests compare, so one training run serves many
assertions (weights, history, callback calls, evaluate, predict, saved files).

Runs are memoized per (case, engine); the twins' reference is shared by the engines that
train the same members (`fused` and `graph`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import keras_gpushare as kg

BACKEND = keras.backend.backend()
TENSORFLOW = BACKEND == "tensorflow"
# The engines a per-engine test runs on: the graph engine only on TensorFlow.
PACK_ENGINES = [
    pytest.param("fused", id="fused"),
    pytest.param(
        "graph",
        id="graph",
        marks=pytest.mark.skipif(not TENSORFLOW, reason="the graph engine runs on TensorFlow"),
    ),
]

# Same-architecture members for "fused" and "graph"; members differing only in their Dense
# width for "widths" (fused with padding with fuse="auto").
ENGINES = ("fused", "graph", "widths")
SAME_WIDTH = 6
WIDTHS = (6, 9, 4, 7)

# Float32 tolerance of every weight and logged figure unless a case says otherwise.
ATOL = 1e-5
RTOL = 1e-5

# The pack's own figures, not any member's: the mean loss over members.
PACK_KEYS = {"loss", "val_loss"}
_MEMBER_KEY = re.compile(r"^(val_)?m(\d+)_(.+)$")


@dataclasses.dataclass(frozen=True)
class Who:
    """Whom a case's callbacks and arguments are for: twin `index`, or the pack (None)."""

    index: int | None
    n: int

    @property
    def is_pack(self) -> bool:
        return self.index is None

    def key(self, name: str, member: int = 0) -> str:
        """A log key as this model logs it: `val_loss` for a twin, `val_m{member}_loss` for
        the pack."""
        if not self.is_pack:
            return name
        if name.startswith("val_"):
            return f"val_m{member}_{name[4:]}"
        return f"m{member}_{name}"


def default_compile(i: int) -> dict:
    return {
        "optimizer": keras.optimizers.Adam((0.01, 0.02, 0.015, 0.005)[i]),
        "loss": "binary_crossentropy",
        "metrics": ["accuracy"],
    }


@dataclasses.dataclass
class Case:
    """One feature under test.

    Args:
        name: the case's id.
        build: `build(i, width)` returns member `i`, seeded by `i` (a new model each call).
        data: `data()` returns the arrays the case uses (a dict); called once per run.
        compile: `compile(i)` returns member `i`'s `compile` arguments (new objects).
        fit: `fit(data, who)` returns the `fit` arguments for `who` (twin or pack).
        callbacks: `callbacks(who, folder)` returns the case's callbacks for `who`.
        train: replaces the plain `fit`: `train(model, who, callbacks, folder, data)` returns
            `(model, history dict)`; the model may be a new one (loaded from a file).
        evaluate: `evaluate(data)` returns `(x, y)` to evaluate and predict on, or None.
        engines: the engines the case runs on (see `ENGINES`).
        n: number of members.
        pack_options: extra `ModelPack` arguments (`data="shard"`).
        pack_compile: `pack_compile(member_args)` returns the pack's `compile` arguments from
            the members' (default: the members' optimizers as a list, the rest shared).
        precompile: compile each member (and twin) with its own arguments before packing.
        context: a context manager factory the whole run executes in (a dtype policy).
        atol, rtol: tolerances of weights and figures.
        files: names of the file checks this case supports (see the tests).
        predict: compare `predict` too (cases whose outputs differ from the basic case).
        must_fuse: the pack must train on the fused engine (`fuse="auto"`).
        tensorflow_only: skip on other backends (tf.data, the graph engine's data modes).
    """

    name: str
    build: Callable[[int, int], keras.Model]
    data: Callable[[], dict]
    compile: Callable[[int], dict] = default_compile
    fit: Callable[[dict, Who], dict] | None = None
    callbacks: Callable[[Who, Path], list] | None = None
    train: Callable[..., tuple[keras.Model, dict]] | None = None
    evaluate: Callable[[dict], tuple] | None = None
    engines: tuple[str, ...] = ENGINES
    n: int = 2
    pack_options: dict = dataclasses.field(default_factory=dict)
    pack_compile: Callable[[list[dict]], dict] | None = None
    precompile: bool = False
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    atol: float = ATOL
    rtol: float = RTOL
    files: tuple[str, ...] = ()
    predict: bool = False
    must_fuse: bool = False
    tensorflow_only: bool = False


class Recorder(keras.callbacks.Callback):
    """Counts each epoch- and train-level hook and keeps the logs each call received.

    It overrides no batch hook, so it does not change how often Keras calls the step
    (a per-batch callback turns off multi-step execution in some engines).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def _record(self, hook: str, logs: dict | None) -> None:
        self.calls.append((hook, {k: _scalar(v) for k, v in (logs or {}).items()}))

    def on_train_begin(self, logs=None):
        self._record("on_train_begin", logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._record("on_epoch_begin", logs)

    def on_epoch_end(self, epoch, logs=None):
        self._record("on_epoch_end", logs)

    def on_test_begin(self, logs=None):
        self._record("on_test_begin", logs)

    def on_test_end(self, logs=None):
        self._record("on_test_end", logs)

    def on_train_end(self, logs=None):
        self._record("on_train_end", logs)


def _scalar(value: Any) -> Any:
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError):
        return value


@dataclasses.dataclass
class Side:
    """What one side (a twin, or the pack) did: its model after training and its records."""

    model: keras.Model
    history: dict
    recorder: Recorder
    folder: Path
    evaluate_list: Any = None
    evaluate_dict: dict | None = None
    predict: Any = None


@dataclasses.dataclass
class Run:
    """One case on one engine: the twins (reference) and the pack."""

    case: Case
    engine_asked: str
    twins: list[Side]
    pack_side: Side

    @property
    def pack(self) -> kg.ModelPack:
        return self.pack_side.model

    @property
    def aliases(self) -> dict:
        """`learning_rate_<member i's optimizer name>` is member i's `learning_rate`."""
        optimizers = getattr(getattr(self.pack, "optimizer", None), "optimizers", None) or []
        return {f"learning_rate_{o.name}": (i, "learning_rate") for i, o in enumerate(optimizers)}

    @property
    def label(self) -> str:
        """Names the case, the engine asked for and the engine the pack trains on."""
        engine = getattr(self.pack, "engine", "?")
        return f"{self.case.name} [{self.engine_asked}: pack.engine={engine!r}, {BACKEND}]"


class RunFailed(Exception):
    """A run that raised, summarised once: every aspect of it fails with this.

    It carries the error and where it was raised as text, so that pytest does not format
    the deep Keras traceback again for each aspect (that took most of an xfailed run's
    time).
    """

    def __init__(self, case: Case, engine: str, error: Exception) -> None:
        frames = traceback.extract_tb(error.__traceback__)[-4:]
        where = "".join(traceback.format_list(frames))
        super().__init__(
            f"{case.name} [{engine}, {BACKEND}] raised {type(error).__name__}: {error}\n"
            f"last frames:\n{where}"
        )


def member_view(logs: dict, i: int, aliases: dict | None = None) -> dict:
    """Member `i`'s figures in a pack's logs, under the names the member alone would log.

    `m{i}_<key>` becomes `<key>` and `val_m{i}_<key>` becomes `val_<key>`; other members'
    keys and the pack's mean `loss`/`val_loss` are left out; any other key (`epoch`,
    `learning_rate`) is the same for every member and kept as it is. `aliases` maps other
    keys to `(member, key)`: Keras's callbacks log a model whose optimizer has
    `optimizers` as `learning_rate_<optimizer name>`, one per member.
    """
    shared, own = {}, {}
    for key, value in logs.items():
        match = _MEMBER_KEY.match(key)
        if aliases and key in aliases:
            member, name = aliases[key]
            if member == i:
                own[name] = value
        elif match:
            if int(match.group(2)) == i:
                own[(match.group(1) or "") + match.group(3)] = value
        elif key not in PACK_KEYS:
            shared[key] = value
    return {**shared, **own}


class Runner:
    """Builds, trains and memoizes runs in `root` (a temporary folder)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._runs: dict[tuple[str, str], Any] = {}
        self._twins: dict[tuple[str, str], list[Side]] = {}
        self._initial: dict[tuple[str, str], list[list[np.ndarray]]] = {}

    def run(self, case: Case, engine: str) -> Run:
        key = (case.name, engine)
        if key not in self._runs:
            try:
                with case.context():
                    self._runs[key] = self._run(case, engine)
            except Exception as e:  # the same failure for every aspect of this run
                self._runs[key] = RunFailed(case, engine, e)
        result = self._runs[key]
        if isinstance(result, RunFailed):
            raise result.with_traceback(None)
        return result

    def _run(self, case: Case, engine: str) -> Run:
        # The pack first: a pack that cannot train fails before the reference is trained.
        pack_side = self._train_pack(case, engine)
        key = _members_key(case, engine)
        if key not in self._twins:
            self._twins[key] = self._train_twins(case, engine)
        return Run(case, engine, self._twins[key], pack_side)

    def _members(self, case: Case, engine: str) -> list[keras.Model]:
        widths = WIDTHS[: case.n] if engine == "widths" else (SAME_WIDTH,) * case.n
        return [case.build(i, w) for i, w in enumerate(widths)]

    def _folder(self, *parts: str) -> Path:
        folder = self.root.joinpath(*parts)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _train_pack(self, case: Case, engine: str) -> Side:
        data = case.data()
        members = self._members(case, engine)
        initial = [m.get_weights() for m in members]
        key = _members_key(case, engine)
        if key in self._initial:  # another engine's pack: the same members, seeded alike
            for i, (ours, first) in enumerate(zip(initial, self._initial[key])):
                assert all(np.array_equal(a, b) for a, b in zip(ours, first)), (
                    f"{case.name}: member {i} was not rebuilt with the same initial weights"
                )
        self._initial[key] = initial
        member_args = [case.compile(i) for i in range(case.n)]
        if case.precompile:
            for member, args in zip(members, member_args):
                member.compile(**args)
            member_args = [case.compile(i) for i in range(case.n)]
        pack = kg.ModelPack(
            members, fuse=False if engine == "graph" else "auto", **case.pack_options
        )
        pack.compile(**(case.pack_compile or _pack_compile_args)(member_args))
        who = Who(None, case.n)
        folder = self._folder(case.name, engine, "pack")
        return self._train(case, pack, who, folder, data)

    def _train_twins(self, case: Case, engine: str) -> list[Side]:
        data = case.data()
        key = _members_key(case, engine)
        sides = []
        for i, twin in enumerate(self._members(case, engine)):
            twin.set_weights(self._initial[key][i])  # the member's initial weights
            twin.compile(**case.compile(i))
            folder = self._folder(case.name, key[1], f"twin{i}")
            sides.append(self._train(case, twin, Who(i, case.n), folder, data))
        return sides

    def _train(self, case: Case, model: keras.Model, who: Who, folder: Path, data: dict) -> Side:
        recorder = Recorder()
        callbacks = [recorder, *(case.callbacks(who, folder) if case.callbacks else [])]
        if case.train is not None:
            model, history = case.train(model, who, callbacks, folder, data)
        else:
            model, history = model, model.fit(**case.fit(data, who), callbacks=callbacks).history
        side = Side(model, history, recorder, folder)
        if case.evaluate is not None:
            x, y = case.evaluate(data)
            # The batch size of validation in fit: evaluate reuses its traced step.
            side.evaluate_list = model.evaluate(x, y, batch_size=16, verbose=0)
            side.evaluate_dict = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
            if case.predict:
                side.predict = model.predict(x, batch_size=16, verbose=0)
        return side


def _members_key(case: Case, engine: str) -> tuple[str, str]:
    """Which members a run trains: `fused` and `graph` train the same ones."""
    return case.name, "widths" if engine == "widths" else "same"


def _pack_compile_args(member_args: list[dict]) -> dict:
    """The pack's `compile` arguments: the members' optimizers as a list, the rest shared."""
    args = dict(member_args[0])
    if "optimizer" in args:
        args["optimizer"] = [a["optimizer"] for a in member_args]
    return args


# Comparisons -------------------------------------------------------------------------------


def close(actual: Any, expected: Any, run: Run, what: str) -> None:
    np.testing.assert_allclose(
        np.asarray(actual, dtype="float64"),
        np.asarray(expected, dtype="float64"),
        atol=run.case.atol,
        rtol=run.case.rtol,
        err_msg=f"{run.label}: {what}",
    )


def assert_weights(run: Run) -> None:
    members = run.pack.members
    for i, twin in enumerate(run.twins):
        ours, theirs = members[i].get_weights(), twin.model.get_weights()
        assert len(ours) == len(theirs), f"{run.label}: member {i} weight count"
        for k, (a, b) in enumerate(zip(ours, theirs)):
            close(a, b, run, f"member {i} weight {k} ({members[i].weights[k].path})")


def assert_figures(pack_logs: dict, twin_logs: dict, i: int, run: Run, what: str) -> None:
    """Member `i`'s figures in the pack's logs equal the twin's: same keys, same values."""
    view = member_view(pack_logs, i, run.aliases)
    assert set(view) == set(twin_logs), (
        f"{run.label}: {what} of member {i}: keys {sorted(view)} in the pack (m{i}_ keys "
        f"unprefixed), {sorted(twin_logs)} for the member alone"
    )
    for key, expected in twin_logs.items():
        close(view[key], expected, run, f"{what} of member {i}, {key!r}")


def assert_history(run: Run) -> None:
    """`m{i}_<key>` == the twin's `<key>` for every key it logs, epoch by epoch.

    A member that stopped before the pack did logs NaN training figures in the pack's
    later epochs (documented in docs/pack.md); its validation figures there evaluate the
    weights it stopped with, which the member alone never logs, so they are not compared.
    Every epoch the twin ran must match.
    """
    pack_history = run.pack_side.history
    for i, twin in enumerate(run.twins):
        view = member_view(pack_history, i, run.aliases)
        assert set(view) == set(twin.history), (
            f"{run.label}: history of member {i}: keys {sorted(view)} in the pack (m{i}_ "
            f"keys unprefixed), {sorted(twin.history)} for the member alone"
        )
        for key, expected in twin.history.items():
            ours = np.asarray(view[key], dtype="float64")
            assert len(ours) >= len(expected), f"{run.label}: member {i} {key!r} epochs"
            close(ours[: len(expected)], expected, run, f"history of member {i}, {key!r}")
            extra = ours[len(expected) :]
            assert key.startswith("val_") or np.all(np.isnan(extra)), (
                f"{run.label}: member {i} stopped after {len(expected)} epochs but the "
                f"pack logs {key!r} = {extra.tolist()} after that (expected NaN)"
            )


def assert_callback_calls(run: Run) -> None:
    """Each hook fires as often as for the member alone, with member `i`'s figures."""
    pack_calls = run.pack_side.recorder.calls
    pack_epochs = _hook_counts(pack_calls).get("on_epoch_end", 0)
    for i, twin in enumerate(run.twins):
        expected = twin.recorder.calls
        if _hook_counts(expected).get("on_epoch_end", 0) < pack_epochs:
            # Member i stopped before the pack (MemberEarlyStopping): its epochs are a
            # prefix of the pack's, and the pack's later figures for it are NaN.
            expected = expected[:-1]
            compared = pack_calls[: len(expected)]
        else:
            compared = pack_calls
            pack_hooks, twin_hooks = _hook_counts(pack_calls), _hook_counts(expected)
            assert pack_hooks == twin_hooks, (
                f"{run.label}: hook calls {pack_hooks} in the pack, {twin_hooks} for member "
                f"{i} alone"
            )
        for k, ((hook, logs), (twin_hook, twin_logs)) in enumerate(zip(compared, expected)):
            assert hook == twin_hook, f"{run.label}: call {k} is {hook}, alone {twin_hook}"
            assert_figures(logs, twin_logs, i, run, f"{hook} logs (call {k})")


def _hook_counts(calls: list) -> dict:
    counts: dict[str, int] = {}
    for hook, _ in calls:
        counts[hook] = counts.get(hook, 0) + 1
    return counts


def assert_evaluate_dict(run: Run) -> None:
    for i, twin in enumerate(run.twins):
        assert_figures(run.pack_side.evaluate_dict, twin.evaluate_dict, i, run, "evaluate")


def assert_evaluate_list(run: Run) -> None:
    """Without `return_dict`, one value per figure, in an order the user can name.

    Plain Keras returns `loss` then the compiled metrics; for a pack the figures are the
    `return_dict=True` keys, so the list must hold them in the dict's order or in the
    order of `pack.metrics_names`.
    """
    figures = run.pack_side.evaluate_dict
    values = np.atleast_1d(np.asarray(run.pack_side.evaluate_list, dtype="float64"))
    assert len(values) == len(figures), (
        f"{run.label}: evaluate returned {len(values)} values for {len(figures)} figures "
        f"{list(figures)}"
    )
    names = list(run.pack.metrics_names)
    if sorted(names) != sorted(figures):
        names = list(figures)
    close(values, [figures[k] for k in names], run, f"evaluate list in the order {names}")


def assert_predict(run: Run) -> None:
    predictions = run.pack_side.predict
    assert len(predictions) == len(run.twins), f"{run.label}: predict returned a list of N"
    for i, twin in enumerate(run.twins):
        ours, theirs = predictions[i], twin.predict
        if isinstance(theirs, dict):
            assert isinstance(ours, dict) and set(ours) == set(theirs), run.label
            for key in theirs:
                close(ours[key], theirs[key], run, f"predict of member {i}, output {key!r}")
        elif isinstance(theirs, (list, tuple)):
            assert len(ours) == len(theirs), run.label
            for k, (a, b) in enumerate(zip(ours, theirs)):
                close(a, b, run, f"predict of member {i}, output {k}")
        else:
            close(ours, theirs, run, f"predict of member {i}")


def files_in(folder: Path) -> list[str]:
    """Every file under `folder`, relative to it."""
    found = []
    for root, _, names in os.walk(folder):
        found.extend(os.path.relpath(os.path.join(root, n), folder) for n in names)
    return sorted(found)
