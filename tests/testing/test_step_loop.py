"""The step loop of benchmarks/gpu_check.py, on the CPU with the torch engine: vLLM's order
of calls under async scheduling, blocks reused at once, every loaded and stored byte
checked. (On a GPU the same loop runs the CuPy engine: gpu_check.sh.)"""

from __future__ import annotations

import pytest

from kv_offload.testing.step_loop import run_step_loop


@pytest.mark.parametrize("background_stores", [False, True], ids=["inline", "background"])
def test_step_loop_moves_every_byte_right(background_stores):
    out = run_step_loop("cpu", steps=150, seed=3, background_stores=background_stores)
    assert out["mismatches"] == 0 and out["stored_mismatches"] == 0, out
    assert out["tokens_loaded"] > 0 and out["chunks_stored"] > 0, out  # both paths ran
    assert out["held"] > 0 and out["preempted"] > 0, out


def test_gpu_check_runs_without_the_optional_packages(tmp_path):
    """The GPU machine has torch and CuPy but maybe no lmdb, xxhash, numba, psutil,
    pytest or vLLM: benchmarks/gpu_check.py's step loop must import and run without them
    (here on the CPU, with those packages hidden)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / "run.py"
    script.write_text(f"""
import importlib.abc, importlib.util, sys
HIDDEN = {{"lmdb", "xxhash", "numba", "llvmlite", "psutil", "redis", "hiredis", "vllm",
          "pytest", "cupy"}}
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ImportError("hidden: " + name)
sys.meta_path.insert(0, Hide())
real = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a: None if n.split(".")[0] in HIDDEN else real(n, *a)
sys.path[:0] = [{str(repo / "benchmarks")!r}, {str(repo)!r}]
import gpu_check
gpu_check.stub_missing()
from kv_offload.testing.step_loop import run_step_loop
out = run_step_loop("cpu", steps=40, seed=2)
assert out["mismatches"] == 0 and out["stored_mismatches"] == 0, out
print("ok", gpu_check.STUBBED, gpu_check.environment()["optional"])
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok ['xxhash']")
