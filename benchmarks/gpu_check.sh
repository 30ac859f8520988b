#!/usr/bin/env bash
# Verifies kv-offload's CUDA path end to end on one GPU, offline, in a few minutes
# (kv_offload/testing/gpu_check.py): the CUDA tests of the copy engines (when pytest is
# there), a step loop in both model runners' orders of calls under async scheduling with
# every byte compared (and with every copy audited), each copy path against one pinned
# cudaMemcpyAsync, a decode step's latency while large copies run (DMA vs kernel), DMA vs
# kernel per range size, and start-up with an unwritable HOME. Runs from a plain copy of
# the repository (no pip install). Needs torch (CUDA) and CuPy only (without CuPy it
# fails); installs nothing (the GPU machine has no package index); what needs another
# missing package is skipped and said so in the JSON.
# Usage: benchmarks/gpu_check.sh [OUTDIR]   (default $OUT or ./gpu-check; writes gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-gpu-check}}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# CuPy compiles the copy kernel into ~/.cupy/kernel_cache, which may not be writable there.
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/kv-offload-cupy-cache}
timeout 230 "$PY" -m kv_offload.testing.gpu_check --out "$OUTDIR" 2>&1 | tee "$OUTDIR/gpu_check.log"
