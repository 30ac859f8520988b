"""The step loop of kv_offload.testing.gpu_check, on the CPU with the torch engine: vLLM's
order of calls under async scheduling, blocks reused at once, every loaded and stored byte
checked. (On a GPU the same loop runs the CuPy engine: benchmarks/gpu_check.sh.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kv_offload.testing.step_loop import StepLoop, run_step_loop

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("background_stores", [False, True], ids=["inline", "background"])
def test_step_loop_moves_every_byte_right(background_stores, runner):
    """Both model runners' orders of calls: V1's, and V2's (vLLM 0.32's default on CUDA:
    handle_preemptions in pre_forward, stores issued in finish_forward before sampling,
    loads and get_finished after it)."""
    # Loads finish on real threads, so a run's path depends on timing; at 150 steps a
    # loaded machine saw no held request in one run (about 2 expected), at 500 about 10.
    out = run_step_loop("cpu", steps=500, seed=3, background_stores=background_stores,
                        runner=runner)
    assert out["runner"] == runner
    assert out["mismatches"] == 0 and out["stored_mismatches"] == 0, out
    assert out["tokens_loaded"] > 0 and out["chunks_stored"] > 0, out  # both paths ran
    assert out["held"] > 0 and out["preempted"] > 0, out


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_step_loop_issues_stores_where_each_runner_does(runner):
    """V2 issues a step's stores in finish_forward: after the forward, before sampling and
    post_forward's loads; V1 in wait_for_save, after the loads start. Either way the
    forward has written every scheduled token and none is sampled yet."""
    loop = StepLoop("cpu", seed=4, runner=runner)
    calls: list[str] = []
    worker = loop.worker
    real_start, real_store = worker.start_loads, worker.run_stores

    def run_stores(jobs):
        calls.append("stores")
        storing = [loop.requests[r] for job in jobs for r in job.req_ids]
        assert all(r.computed == r.request.num_tokens for r in storing)  # not sampled yet
        real_store(jobs)

    worker.start_loads = lambda jobs: (calls.append("loads"), real_start(jobs))[1]
    worker.run_stores = run_stores
    try:
        for _ in range(40):
            calls.clear()
            loop.step()
            if loop.counts["steps"] % 2 == 1:  # V1 starts loads first every other step
                assert calls == (["stores", "loads"] if runner == "v2" else ["loads", "stores"])
        loop.drain()
    finally:
        loop.close()
    assert loop.counts["chunks_stored"] > 0 and loop.stored_mismatches() == 0


def test_step_loop_with_every_copy_audited_finds_nothing_wrong():
    """The runtime audit on every chunk (audit_rate 1): its re-reads run beside held,
    fenced and reused blocks and never report a right copy as wrong."""
    out = run_step_loop("cpu", steps=300, seed=5, background_stores=True, audit_rate=1.0)
    assert out["audit_chunks"] > 0 and out["audit_mismatches"] == 0, out
    assert out["mismatches"] == 0 and out["stored_mismatches"] == 0, out


# Installed as sitecustomize.py: every process started with it on PYTHONPATH sees the
# optional packages as missing, as on the GPU machine: importing one fails and the real
# importlib.util.find_spec says None. (Regression: a replaced find_spec hid that the real
# one raises ValueError for gpu_check's stand-in modules, which failed its first part.)
HIDE_OPTIONAL = """
import sys
for name in ("lmdb", "xxhash", "numba", "llvmlite", "psutil", "redis", "hiredis", "vllm",
             "pytest", "cupy"):
    sys.modules[name] = None
"""


@pytest.fixture
def without_optional(tmp_path):
    """Environment for a child process that cannot import the optional packages."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_OPTIONAL)
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{site}", "PYTHON": sys.executable}


def test_gpu_check_runs_without_the_optional_packages(without_optional):
    """The GPU machine has torch and CuPy but maybe no lmdb, xxhash, numba, psutil,
    pytest or vLLM: kv_offload.testing.gpu_check, the kv_offload package and the step
    loop must import and run without them (here on the CPU, with those packages hidden)."""
    code = """
from kv_offload.testing import gpu_check
stubbed = gpu_check.stub_missing()
from kv_offload.testing.step_loop import run_step_loop
out = run_step_loop("cpu", steps=40, seed=2)
assert out["mismatches"] == 0 and out["stored_mismatches"] == 0, out
print("ok", stubbed, gpu_check.environment()["optional"])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=without_optional, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok ['xxhash']"), proc.stdout


def test_gpu_check_sh_writes_every_part(without_optional, tmp_path):
    """benchmarks/gpu_check.sh as the GPU machine runs it (no pip install, optional
    packages missing): it runs ``python -m kv_offload.testing.gpu_check`` and writes
    gpu_check.json with every part, each a result, a skip or an error (here, without
    CUDA, the CUDA parts fail: the exit status says so), and its log."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)],
                          capture_output=True, text=True, timeout=240, env=without_optional)
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["stubbed_missing_packages"] == ["xxhash"], result
    assert result["environment"]["optional"] == dict.fromkeys(
        ("pytest", "lmdb", "xxhash", "numba", "psutil", "vllm"), False), result
    assert result["cuda_tests"] == {"skipped": "pytest is not installed"}, result
    for part in ("step_loop", "transfer", "decode_latency", "calibration", "startup"):
        assert part in result and part + "_s" in result, result
    if not result["environment"]["cuda_available"]:
        assert proc.returncode != 0 and "error" in result["step_loop"], result
    # Regression: without CuPy every CUDA test was skipped and that part passed; a GPU
    # machine without CuPy checks nothing, and says so by failing.
    assert result["environment"]["ok"] is False and "no CuPy" in result["environment"]["why"]
    log = (out / "gpu_check.log").read_text()
    assert "gpu_check: FAILED: environment" in log, log[-2000:]


def test_gpu_check_fails_where_every_cuda_test_was_skipped(monkeypatch):
    """pytest ran, but CuPy or the device was missing, so every test skipped: not ok."""
    from kv_offload.testing import gpu_check

    class Done:
        returncode, stdout, stderr = 0, "sss\n3 skipped in 0.1s\n", ""

    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: Done())
    assert gpu_check.cuda_tests(10)["ok"] is False
    Done.stdout = "..s\n2 passed, 1 skipped in 0.1s\n"
    assert gpu_check.cuda_tests(10)["ok"] is True


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_step_loop_with_same_step_loads_waits_per_layer_and_moves_every_byte_right(runner):
    """Issue 29: synchronous scheduling, CPU-tier hits loaded in the step that schedules
    them, before the forward on both runners, the forward waiting for each layer before it
    reads it, hits to the last token but one sharing a block with the new token (on the
    CPU the engine copies inline; on a GPU, gpu_check's same_step cases)."""
    loop = StepLoop("cpu", seed=3, runner=runner, same_step=True)
    waits: list[str] = []
    real_wait = loop.worker.layer_waits.wait
    loop.worker.layer_waits.wait = lambda name: (waits.append(name), real_wait(name))[1]
    try:
        for _ in range(150):
            loop.step()
        loop.drain()
        assert loop.counts["same_step_loads"] > 0 and loop.counts["hits_inside_a_block"] > 0
        assert int(loop.mismatches) == 0 and loop.stored_mismatches() == 0
        assert {f"layer{i}" for i in range(4)} <= set(waits)
    finally:
        loop.close()


def test_step_loop_with_a_disk_tier_moves_every_byte_right(tmp_path):
    """The step loop's random workload over the CPU and disk tiers, wired through the tier
    contract as the connector wires them: a CPU tier of 4 slots evicts, so hits are served
    from the disk too; every loaded and stored byte checked."""
    from kv_offload.disk import DiskIndex, SlabFile
    from kv_offload.testing.step_loop import KVShape

    slot_bytes = KVShape().slot_bytes
    index = DiskIndex.open(tmp_path, namespace_id="5e1f", descriptor={"test": "step_loop"},
                           slot_bytes=slot_bytes, num_ranks=1, capacity_bytes=64 * slot_bytes)
    slab = SlabFile(tmp_path, namespace_id="5e1f", rank=0, num_ranks=1, slot_bytes=slot_bytes)
    try:
        out = run_step_loop("cpu", steps=150, seed=6, cpu_slots=4, disk_index=index,
                            slab=slab)
        assert out["mismatches"] == 0 and out["stored_mismatches"] == 0, out
        counters = index.stats()["counters"]
        assert index.stats()["num_entries"] > 0 and counters["hits"] > 0, index.stats()
        assert out["tokens_loaded"] > 0
    finally:
        index.close()
