# Every target creates .venv when it is missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 2

# The oldest versions pyproject.toml declares, to check that the suite passes on them too.
VENV_OLDEST := .venv-oldest
OLDEST_PINS := tensorflow==2.16.1 keras==3.15.1 keras-tuner==1.4.7 "jax[cpu]==0.4.31"

# Two test processes (pytest-xdist), one file each at a time: most tests trace and run small
# Keras programs on one core. Files are dealt in collection order, the slowest first (see
# tests/conftest.py). `make test PYTEST_JOBS=` runs them in one process.
PYTEST_JOBS ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-all test-oldest bench docs lint format clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

$(VENV)/.docs: $(VENV)/.base
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $@

$(VENV)/.bench: $(VENV)/.base
	$(PY) -m pip install --quiet -e ".[bench]"
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/keras-gpushare bench --quick --suggest

# The tests `make test` leaves out (`-m "not slow"`): see the marker in pyproject.toml. It
# keeps every fast test, each public feature and error on every backend that claims it, each
# differential test at its smallest size that still shows a wrong result, and the counting
# tests at one member and 256; the larger twins, the executors, engines and optimizers a
# claim is also tested on and the worker-process twins are `slow`. The aim: at most 20
# minutes on a quiet 2-core machine (README.md says the last measurement).
TEST_SELECTION ?= -m "not slow"
JAX_TESTS := tests/test_upstream.py tests/pack/fusion tests/pack/test_pack_shard_fused.py tests/pack/test_stacked_step.py tests/pack/test_device_loop.py tests/test_docstring_examples.py tests/pack/test_program_cache.py tests/pack/test_one_time_compiles.py tests/pack/test_pack_unregistered_objects.py tests/pack/test_member_copy_state.py tests/pack/test_gc_freeze.py tests/pack/test_member_build.py tests/pack/test_pack_shared_layers.py tests/pack/test_pack_output.py tests/pack/test_pack_member_errors.py tests/pack/test_pack_fused.py tests/pack/test_pack_mixed_precision.py tests/pack/test_pack_mixed.py tests/pack/test_pack_slots.py tests/tuner/test_tuner_slots.py tests/tuner/test_slot_executor.py tests/tuner/conformance/test_conformance_results.py tests/tuner/conformance/test_conformance_behaviour.py tests/tuner/test_tuner_pack.py tests/tuner/test_tuner_resume.py tests/tuner/test_tuner_devices.py tests/tuner/test_space_plan.py tests/tuner/test_search_ledger.py tests/pack/test_backend_seam.py tests/pack/engines tests/conformance

# Each pytest run ends with its 30 slowest tests (none in `make test` should take over 30 s).
test: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy keras_gpushare
	$(PY) -m pytest -q --durations=30 $(PYTEST_JOBS) $(TEST_SELECTION)
	KERAS_BACKEND=jax $(PY) -m pytest -q --durations=30 $(PYTEST_JOBS) $(TEST_SELECTION) $(JAX_TESTS)
	KERAS_BACKEND=torch $(PY) -m pytest -q --durations=30 $(PYTEST_JOBS) $(TEST_SELECTION) tests/test_upstream.py tests/pack/fusion/test_optimizer_transforms.py tests/conformance tests/pack/test_pack_slots.py tests/pack/test_backend_seam.py tests/pack/engines tests/pack/test_stacked_step.py tests/pack/test_pack_shard_fused.py tests/tuner/conformance/test_conformance_behaviour.py::test_seeded_trials_each_train_on_their_own_shuffled_order

# Everything: `make test`'s runs with the slow tests too.
test-all:
	$(MAKE) test TEST_SELECTION=

$(VENV_OLDEST)/.test: pyproject.toml Makefile
	test -x $(VENV_OLDEST)/bin/python || $(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install --upgrade --quiet pip
	$(VENV_OLDEST)/bin/python -m pip install --quiet $(OLDEST_PINS) -e ".[test]"
	touch $@

# Not part of `make test` (it downloads the old wheels, about 1 GiB, and runs the suite again).
test-oldest: $(VENV_OLDEST)/.test
	$(VENV_OLDEST)/bin/python -m pip list 2>/dev/null | grep -iE "^(tensorflow|keras|keras-tuner|jax|jaxlib|numpy) "
	$(VENV_OLDEST)/bin/python -m pytest -q
	KERAS_BACKEND=jax $(VENV_OLDEST)/bin/python -m pytest -q tests/pack/fusion tests/pack/test_pack_fused.py tests/test_docstring_examples.py

bench: $(VENV)/.bench
	$(PY) benchmarks/pack_vs_baselines.py

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy keras_gpushare

format: $(VENV)/.test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(VENV_OLDEST) build site *.egg-info
