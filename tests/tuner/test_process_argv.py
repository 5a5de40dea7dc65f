"""executor="processes" with a script that parses its command line (issue 35, item 4).

Each worker runs the user's script again, as multiprocessing's "spawn" does, and must see
the arguments the user ran it with: a script that parses them with `argparse` at top level
then builds the same models in the workers as the user asked for. A worker that saw other
arguments (its own) fails the script's `--out` requirement and dies, again and again.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tuner_helpers as th
from hang_guard import HANG_GUARD_S

ARGS = ["--out", "{out}", "--units", "5", "--epochs", "2"]  # the defaults are 2 and 1

SCRIPT = textwrap.dedent(
    """
    import argparse
    import json
    import os
    import sys
    import uuid

    import keras
    import keras_gpushare as kg
    {data_import}

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--units", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    ARGS = parser.parse_args()


    def build(hp):
        marker = {{"pid": os.getpid(), "argv": sys.argv[1:], "units": ARGS.units,
                  "epochs": ARGS.epochs}}
        with open(os.path.join(ARGS.out, "built-" + uuid.uuid4().hex), "w") as f:
            json.dump(marker, f)
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(ARGS.units, activation=hp.Choice("act", ["relu", "tanh"])),
            keras.layers.Dense(1, activation="sigmoid"),
        ])
        model.compile("sgd", "binary_crossentropy")
        return model


    def search():
        x, y = data(64)
        tuner = kg.tuner.ParallelTuner(
            build, objective="val_loss", max_trials=2, parallel_trials=2,
            executor="processes", seed=1, directory=ARGS.out, project_name="argv",
            overwrite=True,
        )
        tuner.search(x, y, epochs=ARGS.epochs, validation_split=0.25, verbose=0)
        print("SEARCH DONE", os.getpid(), len(tuner.oracle.trials))

    {call}
    """
)


def _unguarded_script(tmp_path):
    script = tmp_path / "search.py"
    script.write_text(SCRIPT.format(data_import="from tuner_helpers import data", call="search()"))
    return [str(script)]


def _guarded_module_in_a_package(tmp_path):
    """`python -m argvpkg.search`, guarded, finding its data with a relative import."""
    package = tmp_path / "argvpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "shapes.py").write_text("from tuner_helpers import data\n")
    guarded = SCRIPT.format(
        data_import="from .shapes import data",
        call='if __name__ == "__main__":\n    search()',
    )
    (package / "search.py").write_text(guarded)
    return ["-m", "argvpkg.search"]


@pytest.mark.parametrize(
    "launch",
    [
        _unguarded_script,
        pytest.param(_guarded_module_in_a_package, marks=pytest.mark.slow),
    ],
)
def test_workers_see_the_arguments_the_script_was_run_with(tmp_path, launch):
    out = tmp_path / "out"
    out.mkdir()
    args = [a.format(out=str(out)) for a in ARGS]
    result = subprocess.run(
        [sys.executable, *launch(tmp_path), *args],
        cwd=str(tmp_path),
        env=th.script_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done = [line for line in result.stdout.splitlines() if line.startswith("SEARCH DONE")]
    assert len(done) == 1, result.stdout  # only the chief ran the search to its end
    chief_pid, trials = done[0].split()[2:]
    assert trials == "2"
    states = th.trial_states(str(out / "argv"))
    assert sorted(states) == ["0", "1"]
    assert all(status == "COMPLETED" for status, _ in states.values())
    markers = []
    for name in os.listdir(out):
        if name.startswith("built-"):
            with open(out / name) as f:
                markers.append(json.load(f))
    in_workers = [m for m in markers if str(m["pid"]) != chief_pid]
    assert len(in_workers) >= 2  # every trial's model was built in a worker
    # The workers parsed the user's arguments, not their own, nor the defaults.
    assert all(m["argv"] == args for m in in_workers), in_workers
    assert {(m["units"], m["epochs"]) for m in in_workers} == {(5, 2)}
