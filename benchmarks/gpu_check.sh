#!/usr/bin/env bash
# Verifies kv-offload's CUDA path end to end on one GPU, in under 8 minutes:
#   1. makes sure torch (CUDA), cupy and pytest import, installing the CUDA extra
#      (.[cuda12] or .[cuda13], matching torch's CUDA major) when they are missing and a
#      package index is reachable;
#   2. runs the CUDA tests of the copy engines (round trips against a torch reference,
#      stream ordering after compute);
#   3. runs the transfer benchmark: the CuPy engine vs one large pinned cudaMemcpyAsync
#      of the same bytes (target >= 0.8x), both directions.
# Usage: benchmarks/gpu_check.sh [OUTDIR]   (JSON and logs go to OUTDIR, default ./gpu-check)
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-gpu-check}}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import torch, cupy, pytest; assert torch.cuda.is_available()" 2>/dev/null; then
  cuda_major=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])" 2>/dev/null || echo 12)
  echo "== installing the CUDA stack (.[cuda${cuda_major},test])"
  "$PY" -m pip install -q -e ".[cuda${cuda_major},test]"
fi
"$PY" - <<'PY'
import cupy, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())
PY

echo "== CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/copy 2>&1 | tee "$OUTDIR/cuda-tests.log"

echo "== transfer benchmark"
timeout 300 "$PY" benchmarks/bench_copy.py --cuda --json "$OUTDIR/bench_copy_cuda.json" \
  2>&1 | tee "$OUTDIR/bench-copy.log"
echo "gpu_check: OK (results in $OUTDIR)"
