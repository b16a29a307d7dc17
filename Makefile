# commspan developer tasks. `make help` lists them.
#
# Each target sets up what it needs: a virtualenv ($(VENV)) with torch pinned
# *first* (an unpinned torch may pull a multi-GB CUDA build), then commspan in
# editable mode with its test extras. Stamp files inside the venv make a second
# run skip the installs. Override on the command line, e.g.
#   make test VENV=/tmp/venv PYTEST_ARGS="-x tests/test_jsonl.py"

PYTHON          ?= python3
VENV            ?= .venv
PHOENIX_VENV    ?= .venv-phoenix
TORCH           ?= torch==2.13.0
# e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu: on Linux, PyPI's torch
# wheel is the CUDA build; empty keeps pip's own index (and its configuration)
TORCH_INDEX     ?=
PHOENIX         ?= arize-phoenix==20.26.1
PIP_FLAGS       ?= --quiet --disable-pip-version-check
DEMO_ARGS       ?=
PYTEST_ARGS     ?=
BENCH_ARGS      ?=
CHROMIUM        ?= chromium

PY := $(VENV)/bin/python
# one stamp per pinned requirement: changing the pin reinstalls
TORCH_STAMP   := $(VENV)/.stamp-$(subst =,-,$(TORCH))
PROJECT_STAMP := $(VENV)/.stamp-commspan
DEV_STAMP     := $(VENV)/.stamp-commspan-dev
PHOENIX_STAMP := $(PHOENIX_VENV)/.stamp-$(subst =,-,$(PHOENIX))

.PHONY: help venv demo test bench phoenix lint browser screenshots

help:
	@echo "make demo     4 gloo ranks train a tensor-parallel toy Transformer under commspan"
	@echo "make test     run the test suite (python -m pytest -q)"
	@echo "make bench    run the benchmarks (python -m benchmarks; BENCH_ARGS=--quick)"
	@echo "make phoenix  $(PHOENIX_VENV) with $(PHOENIX), for the backend end-to-end test"
	@echo "make lint     ruff and mypy (installs the dev extra); fails on findings"
	@echo "make browser  Debian's chromium, for the HTML report's browser tests (needs root)"
	@echo "make screenshots  redo docs/images/*.png from the browser tests"
	@echo "make venv     only set up $(VENV)"

venv: $(PROJECT_STAMP)

$(TORCH_STAMP):
	@test -x $(VENV)/bin/pip || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	@touch $@

$(PROJECT_STAMP): $(TORCH_STAMP) pyproject.toml
	$(PY) -m pip install $(PIP_FLAGS) -e ".[test]"
	@touch $@

demo: $(PROJECT_STAMP)
	$(PY) examples/tp_transformer.py $(DEMO_ARGS)

test: $(PROJECT_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(PROJECT_STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

phoenix: $(PHOENIX_STAMP)

$(PHOENIX_STAMP):
	@test -x $(PHOENIX_VENV)/bin/pip || $(PYTHON) -m venv $(PHOENIX_VENV)
	$(PHOENIX_VENV)/bin/python -m pip install $(PIP_FLAGS) "$(PHOENIX)"
	@touch $@

lint: $(DEV_STAMP)
	$(PY) -m ruff check commspan tests examples tools benchmarks
	$(PY) -m mypy

$(DEV_STAMP): $(PROJECT_STAMP)
	$(PY) -m pip install $(PIP_FLAGS) -e ".[dev]"
	@touch $@

# Headless Chromium for tests/test_browser.py: installed from Debian's packages
# only when missing, so running it again costs nothing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v $(CHROMIUM) >/dev/null 2>&1 || { \
		echo "installing chromium (Debian package) for the browser tests"; \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	@$(CHROMIUM) --version 2>/dev/null

screenshots: $(PROJECT_STAMP) browser
	COMMSPAN_SCREENSHOTS_DIR=docs/images $(PY) -m pytest -q tests/test_browser.py -k screenshots
