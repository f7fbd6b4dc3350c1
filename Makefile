# Thin wrappers: every target works on a fresh machine (it installs what it needs).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/glm5.yaml
OUT    ?= artifacts/glm5
JOBS   ?= 2
# pytest selection; GPU tests skip themselves without a GPU.
TESTS  ?= tests

.PHONY: install build build-all test lint format bench clean mutations gpu-check

# The venv is rebuilt when pyproject.toml changes. torch is installed first on
# its own: a plain range would pull a multi-GB CUDA build where a CPU wheel
# (2.13.0) is at hand; any torch >= 2.6 works.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0" \
		|| $(PY) -m pip install -q "torch>=2.6"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

## build: install, then compile $(CONFIG) for every kernel, arch and bucket into $(OUT)
build: install
	$(VENV)/bin/moe-build compile $(CONFIG) -o $(OUT) --jobs $(JOBS)

## build-all: every config under configs/ that validates (all seven), each into artifacts/<name>
## (2 cores, uncached: 142-217 s a config, 20 min in all; configs/README.md)
build-all: install
	@for c in configs/*.yaml; do n=$$(basename $$c .yaml); \
	  if $(VENV)/bin/moe-build validate $$c >/dev/null 2>&1; then \
	    $(VENV)/bin/moe-build compile $$c -o artifacts/$$n --jobs $(JOBS) || exit 1; \
	  else echo "skip $$c: moe-build validate refuses it (configs/README.md says why)"; fi; \
	done

## test: install, then run the test suite (CPU; GPU tests skip without a GPU)
test: install
	$(VENV)/bin/pytest -q $(TESTS)

## mutations: make each listed mistake in a scratch copy; its tests must fail (tests/mutations.py)
mutations: install
	$(PY) tests/mutations.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## bench: on a GPU machine, time the kernels of $(OUT) against the HBM floor and torch
bench: install
	$(VENV)/bin/moe-build bench $(OUT) --routing random --routing skewed --routing uniform \
		--json benchmarks/results/latest.json --plot benchmarks/results/latest.png

## gpu-check: on a GPU machine, the bench, host profile, sanitizers and every GPU test of $(OUT)
gpu-check: install
	PATH=$(VENV)/bin:$$PATH tests/gpu/acceptance.sh $(OUT) benchmarks/results/latest-check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
