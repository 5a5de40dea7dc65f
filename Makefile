# Every target creates .venv when it is missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test bench docs lint format clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
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

test: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q
	KERAS_BACKEND=jax $(PY) -m pytest -q tests/pack/fusion tests/pack/test_pack_fused.py tests/pack/test_pack_mixed_precision.py tests/pack/test_pack_mixed.py

bench: $(VENV)/.bench
	$(PY) benchmarks/pack_vs_baselines.py

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build site *.egg-info
