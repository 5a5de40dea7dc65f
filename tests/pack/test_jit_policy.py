"""`jit_compile="auto"`: when XLA pays for a fused pack's training step.

The decisions are checked on given numbers (no clock is read), the switch on a stand-in
model fed given call times, and on TensorFlow a real pack that switches to XLA mid-`fit`
against each member trained alone with plain `fit`.
"""

import keras
import numpy as np
import pytest
from pack_builders import assert_weights_close, copy_model, mlp

import keras_gpushare as kg
from keras_gpushare.pack._backend import has_tensorflow_gpu
from keras_gpushare.pack._compiling import _jit_policy
from keras_gpushare.pack._compiling._jit_policy import (
    OFF,
    PAYBACK,
    XLA,
    JitPolicy,
    PaybackCosts,
    PaybackSwitch,
    choose_mode,
    pays_back,
)

TENSORFLOW = keras.backend.backend() == "tensorflow"


# Decisions on given numbers --------------------------------------------------------------


def test_a_short_fit_stays_without_xla():
    # 8 small MLPs, 4 epochs of 57 batches: decided after the second call, 2 epochs left.
    assert not pays_back(remaining_batches=2 * 57, seconds_per_batch=0.004, trace_seconds=2.4)


def test_a_long_fit_compiles_with_xla():
    # The seeds' MLP x 16, 782 batches an epoch, 50 epochs left.
    assert pays_back(remaining_batches=50 * 782, seconds_per_batch=0.0025, trace_seconds=1.5)


def test_nothing_left_or_no_speedup_never_pays():
    assert not pays_back(0, 0.01, 0.1)
    assert not pays_back(10**9, 0.01, 0.1, PaybackCosts(speedup=1.0))


def test_the_threshold_is_the_margin_times_the_compile_time():
    costs = PaybackCosts(speedup=2.0, compile_per_trace=3.0, shapes=2, margin=1.5)
    # Compile time 1 s * (1 + 2 * 3) = 7 s; 1.5 * 7 = 10.5 s to earn; 0.5 s saved a batch.
    assert costs.compile_seconds(1.0) == pytest.approx(7.0)
    assert not pays_back(21, 1.0, 1.0, costs)
    assert pays_back(22, 1.0, 1.0, costs)


@pytest.mark.parametrize(
    "supported, backend, accelerator, mode",
    [
        (False, "tensorflow", True, OFF),
        (True, "torch", True, OFF),
        (True, "jax", False, XLA),
        (True, "tensorflow", True, XLA),
        (True, "tensorflow", False, PAYBACK),
    ],
)
def test_mode_by_backend_and_device(supported, backend, accelerator, mode):
    assert choose_mode(supported, backend, accelerator) == mode


def test_only_payback_starts_without_xla_and_adds_a_callback():
    assert JitPolicy(XLA).initial and not JitPolicy(XLA).callbacks()
    assert not JitPolicy(OFF).initial and not JitPolicy(OFF).callbacks()
    policy = JitPolicy(PAYBACK)
    assert not policy.initial
    assert [type(c) for c in policy.callbacks()] == [PaybackSwitch]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="Invalid value for argument `mode`: got 'fast'"):
        JitPolicy("fast")


# The switch, fed given call times ------------------------------------------------------


# Fixed figures, so that the defaults can be re-measured without changing these tests.
COSTS = PaybackCosts(speedup=2.0, compile_per_trace=3.0, shapes=2, margin=1.5)


@pytest.fixture
def keras_allows_xla(monkeypatch):
    monkeypatch.setattr(_jit_policy._upstream, "model_supports_jit", lambda model: True)


class StandInModel:
    """What the switch uses of a Keras model: its training function and `jit_compile`."""

    def __init__(self):
        self.jit_compile = False
        self.steps_per_execution = 10
        self.built_with = []
        self.train_function = self.make_function(False)

    def make_function(self, jit):
        def function(iterator):
            return {"jit": jit}

        return function

    def make_train_function(self, force=False):
        self.built_with.append(self.jit_compile)
        self.train_function = self.make_function(self.jit_compile)


def start(policy, model, steps=100, epochs=10):
    switch = policy.callbacks()[0]
    switch.set_model(model)
    switch.set_params({"steps": steps, "epochs": epochs})
    switch.on_train_begin()
    switch.on_epoch_begin(0)
    return switch


def test_stays_without_xla_when_the_rest_of_the_fit_does_not_repay_the_compile(keras_allows_xla):
    policy, model = JitPolicy(PAYBACK, COSTS), StandInModel()
    switch = start(policy, model)
    # 10 batches a call. The first call traces: 1 s beyond its 10 batches at 10 ms. Then
    # 980 batches left save 980 * 10 ms * (1 - 1/2) = 4.9 s < 1.5 * 1 s * (1 + 2 * 3).
    switch.record(1.0 + 10 * 0.01)
    switch.record(0.1)
    assert policy.trace_seconds == pytest.approx(1.0)
    assert policy.xla_function is None and model.built_with == []
    assert model.train_function({})["jit"] is False


def test_switches_to_xla_when_it_pays_and_keeps_it_when_faster(keras_allows_xla):
    policy, model = JitPolicy(PAYBACK, COSTS), StandInModel()
    switch = start(policy, model)
    # A step traced in 0.3 s: 4.9 s saved > 1.5 * 0.3 s * 7 = 3.15 s.
    switch.record(0.3 + 10 * 0.01)
    assert policy.xla_function is None
    switch.record(0.1)
    assert policy.xla_function is not None
    assert model.built_with == [True] and model.jit_compile is False
    assert model.train_function({})["jit"] is True
    for seconds in (5.0, 0.04, 0.04, 0.04):  # compile, then faster than 0.1 s a call
        switch.record(seconds)
    assert model.train_function({})["jit"] is True
    switch.on_train_end()
    assert model.train_function is policy.xla_function


def test_goes_back_to_the_plain_step_when_xla_is_slower(keras_allows_xla):
    policy, model = JitPolicy(PAYBACK, PaybackCosts(margin=0.0)), StandInModel()
    plain = model.train_function
    switch = start(policy, model)
    switch.record(0.5)
    switch.record(0.1)
    assert policy.xla_function is not None
    for seconds in (5.0, 0.2, 0.2, 0.2):
        switch.record(seconds)
    assert model.train_function({})["jit"] is False
    switch.on_train_end()
    assert model.train_function is plain
    assert policy.gave_up and not policy.callbacks()


def test_does_not_decide_before_the_size_of_an_epoch_is_known(keras_allows_xla):
    policy, model = JitPolicy(PAYBACK, PaybackCosts(margin=0.0)), StandInModel()
    switch = start(policy, model, steps=None, epochs=3)
    for seconds in (0.5, 0.1, 0.1):
        switch.record(seconds)
    assert policy.xla_function is None
    switch.on_epoch_begin(1)  # epoch 0 took 3 calls of 10 batches
    switch.record(0.1)
    assert policy.xla_function is not None


def test_a_fit_on_the_xla_function_is_left_alone(keras_allows_xla):
    policy, model = JitPolicy(PAYBACK), StandInModel()
    policy.xla_function = model.train_function
    start(policy, model)
    assert model.train_function is policy.xla_function


def test_a_later_fit_on_the_traced_function_decides_from_its_first_call(keras_allows_xla):
    policy, model = JitPolicy(PAYBACK, COSTS), StandInModel()
    switch = start(policy, model, epochs=1)
    switch.record(1.0 + 10 * 0.01)
    switch.record(0.1)
    switch.on_train_end()
    assert policy.trace_seconds == pytest.approx(1.0) and policy.xla_function is None
    # Keras keeps the traced function: 3,000 batches left save 15 s > 1.5 * 1 s * 7.
    switch = start(policy, model, epochs=30)
    switch.record(0.1)
    assert policy.xla_function is not None


def test_gives_up_where_keras_refuses_xla(monkeypatch):
    # As Keras does with TensorFlow's op determinism on, or a layer without XLA support.
    monkeypatch.setattr(_jit_policy._upstream, "model_supports_jit", lambda model: False)
    policy, model = JitPolicy(PAYBACK, PaybackCosts(margin=0.0)), StandInModel()
    switch = start(policy, model)
    switch.record(0.5)
    switch.record(0.1)
    assert policy.xla_function is None and model.built_with == []
    assert model.train_function({})["jit"] is False
    assert policy.gave_up and not policy.callbacks()


# On TensorFlow: members still equal plain fits -------------------------------------------


def train_alone(models, x, y, epochs):
    for model in models:
        model.compile(optimizer="adam", loss="binary_crossentropy")
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)


@pytest.mark.skipif(not TENSORFLOW, reason="the pay-back switch is for TensorFlow")
def test_default_pack_members_equal_plain_fits(binary_data):
    x, y = binary_data
    members = [mlp(8, seed=s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    pack.compile(optimizer="adam", loss="binary_crossentropy")
    on_cpu = not has_tensorflow_gpu()
    assert pack._jit_policy.mode == (PAYBACK if on_cpu else XLA)
    assert pack.jit_compile is not on_cpu
    pack.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert pack._jit_policy.xla_function is None  # one call an epoch: nothing left to repay
    train_alone(twins, x, y, 2)
    for member, twin in zip(pack.members, twins):
        assert_weights_close(member, twin)


@pytest.mark.skipif(not TENSORFLOW, reason="the pay-back switch is for TensorFlow")
def test_switching_to_xla_mid_fit_keeps_members_equal_to_plain_fits(binary_data, caplog):
    x, y = binary_data
    members = [mlp(8, seed=s) for s in range(3)]
    twins = [copy_model(m) for m in members]
    pack = kg.ModelPack(members)
    # One batch a call, and a margin that makes XLA pay at once: it switches after batch 2.
    pack.compile(
        optimizer="adam", loss="binary_crossentropy", jit_compile=False, steps_per_execution=1
    )
    policy = JitPolicy(PAYBACK, PaybackCosts(margin=0.0))
    caplog.set_level("INFO", logger="keras_gpushare.pack")
    history = pack.fit(
        x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=policy.callbacks()
    )
    # Whether XLA then stays (faster) or is dropped again (slower) depends on the machine's
    # load; either way the members must train as alone.
    assert "compiling the training step with XLA" in caplog.text
    assert pack.jit_compile is False  # evaluation and prediction stay without XLA
    train_alone(twins, x, y, 3)
    for member, twin in zip(pack.members, twins):
        assert_weights_close(member, twin)
    assert np.all(np.isfinite(history.history["loss"]))


def test_the_module_logs_under_the_packs_logger():
    assert _jit_policy.logger.name == "keras_gpushare.pack"
