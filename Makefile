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

.PHONY: help install test lint pytest demo bench clean

help:
	@echo "make test   install into .venv (once) and run lint + the test suite"
	@echo "make demo   cold / CPU-tier / disk-tier run of a long-prefix workload (MODEL=... for a real model,"
	@echo "            HYBRID=1 for a sliding-window + full attention model, vLLM's hybrid KV cache manager on)"
	@echo "make bench  run the CPU benchmark set and rewrite docs/benchmarks.md"

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON_BOOT) >/dev/null || { echo "error: $(PYTHON_BOOT) not found; install Python 3.11 or pass PYTHON_BOOT=..." >&2; exit 1; }
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[cpu,remote,test,cuda-api]'
	$(PIP) uninstall -y $(CUDA_ONLY_EXTRAS)
	$(PY) -c "import vllm, lmdb, xxhash, redis, kv_offload; print('installed vllm', vllm.__version__)"
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check kv_offload tests examples benchmarks
	$(VENV)/bin/mypy  # kv_offload/, settings in pyproject.toml [tool.mypy]

pytest: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint pytest

demo: $(STAMP)
	$(PY) examples/demo.py $(if $(MODEL),--model $(MODEL),) $(if $(filter 1,$(HYBRID)),--hybrid,)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
