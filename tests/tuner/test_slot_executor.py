"""The slots executor at its seam: driven by a scripted feed of trials, no tuner or oracle.

Five trials of different widths, depths and learning rates go through two slots: the
executor asks for a trial the moment a slot frees, loads it into the program it opened
for the first two, and reports one outcome per trial whose history equals the same model
fitted alone with plain Keras from the same initial weights. Runs on TensorFlow and JAX.
"""

import dataclasses

import keras
import keras_tuner
import numpy as np

from keras_gpushare.tuner._executor import TrialCalls, TrialFeed
from keras_gpushare.tuner._program_executor import ProgramExecutor

FIT = dict(epochs=2, batch_size=16, shuffle=False, verbose=0)
# (units, hidden layers, learning rate): trials 2-4 differ from the first two in every one.
TRIALS = [(8, 2, 1e-2), (6, 1, 5e-3), (4, 1, 2e-2), (8, 2, 3e-3), (3, 2, 1e-2)]
WIDE = (16, 1, 1e-2)  # wider than the slots of a program opened for trials 0 and 1


@dataclasses.dataclass
class _Trial:
    trial_id: str
    hyperparameters: keras_tuner.HyperParameters


def _model(hp) -> keras.Model:
    units, hidden, rate = [*TRIALS, WIDE][hp.get("trial")]
    keras.utils.set_random_seed(hp.get("trial"))
    layers = [keras.Input((5,))]
    layers += [keras.layers.Dense(units, activation="tanh") for _ in range(hidden)]
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(rate), "mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 5)).astype("float32")
    return x, x[:, :2].sum(axis=1, keepdims=True)


class _Feed:
    """Hands out the trials one slot number at a time; records what was asked and ended.

    With `in_turn`, a trial after the first two is handed out only once every earlier one
    has ended, as GridSearch answers IDLE until its open trials end.
    """

    def __init__(self, trials=None, in_turn=False):
        self.waiting = []
        for i in range(len(TRIALS)) if trials is None else trials:
            hp = keras_tuner.HyperParameters()
            hp.Fixed("trial", i)
            self.waiting.append(_Trial(f"{i:02d}", hp))
        self.total, self.in_turn = len(self.waiting), in_turn
        self.asked, self.outcomes = [], {}

    def next_trials(self, slots, running=False):
        handed = self.total - len(self.waiting)
        open_ = handed - len(self.outcomes)
        self.asked.append((list(slots), running, open_, len(self.outcomes) == self.total))
        if not self.waiting or (self.in_turn and handed >= 2 and open_):
            return []
        return [self.waiting.pop(0)]

    def end_trials(self, trials, outcomes):
        self.outcomes.update(outcomes)


def _calls(tmp_path) -> TrialCalls:
    def ignore(*args, **kwargs):
        return None

    return TrialCalls(
        objective=keras_tuner.Objective("loss", "min"),
        executions_per_trial=1,
        fuse="auto",
        build_model=_model,
        run_alone=ignore,
        copy_callbacks=list,
        configure_tensorboard=ignore,
        checkpoint_file=lambda trial_id: str(tmp_path / f"{trial_id}.weights.h5"),
        save_build_config=ignore,
        on_epoch_begin=ignore,
        on_epoch_end=ignore,
        on_batch_begin=ignore,
        on_batch_end=ignore,
        batch_hooks=False,
        epoch_end_hook=False,
    )


def _assert_each_trains_as_alone(feed):
    """Each trial's losses equal its model's plain `fit` from the same initial weights."""
    for trial_id, outcome in feed.outcomes.items():
        hp = keras_tuner.HyperParameters()
        hp.Fixed("trial", int(trial_id))
        alone = _model(hp).fit(*_data(), **FIT).history
        got = outcome.results[0].history
        np.testing.assert_allclose(got["loss"], alone["loss"], rtol=1e-5, err_msg=trial_id)


def test_trials_stream_through_two_slots_and_train_as_alone(tmp_path):
    feed = _Feed()
    executor = ProgramExecutor(_calls(tmp_path), refills=True)
    executor.run(TrialFeed(2, feed.next_trials, feed.end_trials), _data(), dict(FIT))

    assert sorted(feed.outcomes) == [f"{i:02d}" for i in range(len(TRIALS))]
    paths = {k: o.path for k, o in feed.outcomes.items()}
    assert {p["program"] for p in paths.values()} == {"0"}, paths
    assert all(p["why"].startswith("loaded into slot") for k, p in paths.items() if k >= "02")
    # A slot is asked for while the other trains (`running`), one slot number at a time.
    assert any(running for _, running, _, _ in feed.asked)
    assert all(len(slots) == 1 for slots, _, _, _ in feed.asked)
    # `running=False` (to a local oracle: an IDLE answer ends the search) only while no
    # trial it gave is open (GridSearch answers IDLE until its open trials end).
    assert all(running or not open_ for _, running, open_, _ in feed.asked), feed.asked
    # Once every trial has ended, each slot number is told the search is over once, and
    # none asks again: a distributed chief exits when each tuner id was told (CI once
    # hung for the worker's next question to a chief that was gone).
    after_the_end = [slots[0] for slots, _, _, over in feed.asked if over]
    assert sorted(after_the_end) == [0, 1], feed.asked
    for trial_id, outcome in feed.outcomes.items():
        assert outcome.error is None
        hp = keras_tuner.HyperParameters()
        hp.Fixed("trial", int(trial_id))
        alone = _model(hp).fit(*_data(), **FIT).history
        got = outcome.results[0].history
        np.testing.assert_allclose(got["loss"], alone["loss"], rtol=1e-5, err_msg=trial_id)
        assert outcome.results[0].epoch == [0, 1]


def test_a_trial_waiting_for_a_program_keeps_the_oracle_busy(tmp_path):
    """Trials 0 and 1 end together; the next trial is too wide for their program and waits
    for one of its own, while the oracle holds the last trial until it ends (GridSearch).
    The oracle is asked with `running=True` meanwhile, so the search goes on to the end."""
    wide = len(TRIALS)
    feed = _Feed(trials=[0, 1, wide, 2], in_turn=True)
    ProgramExecutor(_calls(tmp_path), refills=True).run(
        TrialFeed(2, feed.next_trials, feed.end_trials), _data(), dict(FIT)
    )

    assert sorted(feed.outcomes) == ["00", "01", "02", f"{wide:02d}"], feed.asked
    assert all(running or not open_ for _, running, open_, _ in feed.asked), feed.asked
    paths = {k: o.path for k, o in feed.outcomes.items()}
    assert paths[f"{wide:02d}"]["program"] == "1", paths
    for trial_id, outcome in feed.outcomes.items():
        assert outcome.error is None, trial_id


def test_a_long_search_fuses_its_programs_update_and_trials_still_train_as_alone(tmp_path, caplog):
    """Where the oracle's remaining trials promise enough steps (`_update_payback`), a
    TensorFlow CPU program compiles its optimizer update with XLA and says so; its trials
    train as they would alone. A search of unknown length keeps the plain update."""
    import logging

    fused = keras.backend.backend() == "tensorflow"
    if fused:
        import tensorflow as tf

        fused = not tf.config.list_physical_devices("GPU")
    for remaining, expected in ((lambda: 10**9, fused), (lambda: None, False)):
        feed = _Feed()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="keras_gpushare.tuner"):
            ProgramExecutor(_calls(tmp_path), refills=True).run(
                TrialFeed(2, feed.next_trials, feed.end_trials, remaining_trials=remaining),
                _data(),
                dict(FIT),
            )
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Program 0")]
        assert said and said[0].endswith(
            "; its optimizer update compiled with XLA." if expected else "engine)."
        ), said
        _assert_each_trains_as_alone(feed)


def test_a_program_planned_from_the_space_takes_every_trial_and_each_trains_as_alone(tmp_path):
    """Given the space (`TrialCalls.space`), the executor probes it before its first
    program: at the numbers' extremes, the widest trial (16 units, one layer) and trial 0
    (two layers). The one program they plan takes every trial, the wide one included, and
    each trains as it would alone, though each probe build seeded the generators."""
    space = keras_tuner.HyperParameters()
    space.Choice("trial", list(range(len(TRIALS) + 1)))
    calls = dataclasses.replace(_calls(tmp_path), space=space.copy)
    wide = len(TRIALS)
    feed = _Feed(trials=[0, 1, wide, 2, 3, 4])
    executor = ProgramExecutor(calls, refills=True)
    executor.run(TrialFeed(2, feed.next_trials, feed.end_trials), _data(), dict(FIT))

    paths = {k: o.path for k, o in feed.outcomes.items()}
    assert sorted(paths) == ["00", "01", "02", "03", "04", f"{wide:02d}"]
    assert {p["program"] for p in paths.values()} == {"0"}, paths
    assert all("planned from the space: 1 template from" in p["why"] for p in paths.values())
    assert calls.ledger.programs == 1 and calls.ledger.probes >= 2
    _assert_each_trains_as_alone(feed)
