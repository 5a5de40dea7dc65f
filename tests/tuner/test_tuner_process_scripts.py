"""executor="processes" from scripts as users write them (items 18 and 19).

A script without `if __name__ == "__main__":`, with its own ParallelTuner subclass, runs in
worker processes that keep the subclass; a script read from standard input works when its
hypermodel is importable, and fails within seconds, naming the fix, when it is not.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import tuner_helpers as th
from hang_guard import HANG_GUARD_S

UNGUARDED = textwrap.dedent(
    """
    import os
    import keras
    import numpy as np
    import keras_gpushare as kg

    MARKERS = {markers!r}


    def build(hp):
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(hp.Choice("units", [4, 8]), activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ])
        model.compile("sgd", "binary_crossentropy")
        return model


    class MarkingTuner(kg.tuner.ParallelTuner):
        def run_trial(self, trial, *args, **kwargs):
            open(os.path.join(MARKERS, f"run-{{trial.trial_id}}-{{os.getpid()}}"), "w").close()
            return super().run_trial(trial, *args, **kwargs)

        def on_trial_end(self, trial):
            open(os.path.join(MARKERS, f"end-{{trial.trial_id}}-{{os.getpid()}}"), "w").close()
            super().on_trial_end(trial)


    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    tuner = MarkingTuner(
        build, objective="val_loss", max_trials=2, parallel_trials=2, executor="processes",
        seed=1, directory={directory!r}, project_name="unguarded", overwrite=True,
    )
    tuner.search(x, y, epochs=1, validation_split=0.25, verbose=0)
    print("SEARCH DONE", os.getpid(), len(tuner.oracle.trials))
    """
)


def test_unguarded_script_with_a_subclass_runs_in_workers_that_keep_it(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    script = tmp_path / "search.py"
    script.write_text(UNGUARDED.format(markers=str(markers), directory=str(tmp_path)))
    result = subprocess.run(
        [sys.executable, str(script)],
        env=th.script_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done = [line for line in result.stdout.splitlines() if line.startswith("SEARCH DONE")]
    assert len(done) == 1, result.stdout  # the workers stopped at the script's search
    chief_pid, trials = done[0].split()[2:]
    assert trials == "2"
    states = th.trial_states(str(tmp_path / "unguarded"))
    assert sorted(states) == ["0", "1"]
    assert all(status == "COMPLETED" for status, _ in states.values())
    names = [name.split("-") for name in os.listdir(markers)]
    # The subclass's run_trial and on_trial_end ran for every trial, in worker processes.
    assert sorted(trial for kind, trial, _ in names if kind == "run") == ["0", "1"]
    assert sorted(trial for kind, trial, _ in names if kind == "end") == ["0", "1"]
    assert chief_pid not in {pid for _, _, pid in names}


STDIN_IMPORTABLE = """
import tuner_helpers
import keras_gpushare as kg

x, y = tuner_helpers.data(64)
tuner = kg.tuner.ParallelTuner(
    tuner_helpers.build_mlp, objective="val_loss", max_trials=2, parallel_trials=1,
    executor="processes", seed=1, directory={directory!r}, project_name="stdin",
)
tuner.search(x, y, epochs=1, validation_split=0.25, verbose=0)
print("STDIN DONE", len(tuner.oracle.trials))
"""


def test_a_script_on_standard_input_with_an_importable_hypermodel_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-"],
        input=STDIN_IMPORTABLE.format(directory=str(tmp_path)),
        env=th.script_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STDIN DONE 2" in result.stdout
    states = th.trial_states(str(tmp_path / "stdin"))
    assert [status for status, _ in states.values()] == ["COMPLETED", "COMPLETED"]


STDIN_MAIN_BUILD = """
import keras
import tuner_helpers
import keras_gpushare as kg


def build(hp):
    return tuner_helpers.build_mlp(hp)


x, y = tuner_helpers.data(64)
tuner = kg.tuner.ParallelTuner(
    build, objective="val_loss", max_trials=2, parallel_trials=2, {option},
    directory={directory!r}, project_name="notebook",
)
tuner.search(x, y, epochs=1, validation_split=0.25, verbose=0)
"""


@pytest.mark.parametrize(
    "option, named, way_out",
    [
        ('executor="processes"', 'executor="processes"', 'use executor="pack"'),
        # The executor left at its default: the error names what the user set.
        ('devices=["cpu0"]', "`devices`", "leave `devices` out to train the trials in this"),
    ],
)
def test_a_hypermodel_defined_on_standard_input_fails_fast_naming_the_fix(
    tmp_path, option, named, way_out
):
    result = subprocess.run(
        [sys.executable, "-"],
        input=STDIN_MAIN_BUILD.format(directory=str(tmp_path), option=option),
        env=th.script_env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"ValueError: {named} trains the trials in worker processes, ")
    assert "`build`" in error and "defined in `__main__` of an interactive" in error
    assert "module file" in error and way_out in error
    if option.startswith("devices"):
        assert "executor=" not in error
    # Refused in the chief before any worker started: no trial was created.
    assert not th.trial_states(str(tmp_path / "notebook"))
