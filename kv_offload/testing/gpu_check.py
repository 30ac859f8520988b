"""kv-offload's CUDA path end to end on one GPU, offline, in a few minutes.

Runs from the working tree with what a GPU machine has (torch and CuPy; no vLLM, no
package index; pytest, lmdb, xxhash, numba, psutil optional: what is missing is skipped
and said so; CuPy missing is a failure). Each part writes into one JSON file:

1. ``environment``: torch, CUDA, CuPy, the device, the driver (batch copies, stream
   priorities); not ok without CuPy or a device.
2. ``cuda_tests``: the CUDA tests of the copy engines and the CuPy API checks
   (pytest tests/copy); not ok when nothing passed.
3. ``step_loop``: ``kv_offload.testing.step_loop`` on CUDA with a forward of
   ``--forward-ms`` on a side stream that runs behind the host, blocks reused at once,
   every loaded and stored byte compared (mismatches must be 0), in both model runners'
   orders (``v1``, ``v2``; engines whose new blocks V2 zeroes before the fence, mamba or
   mixed precisions, are refused at start-up, so that order is not run), and V1 with
   every copy audited
   (``audit``: no audit mismatch either), and both orders with same-step loads waited
   for per layer (``same_step_v1``, ``same_step_v2``; ``same_step_loads`` must be > 0).
4. ``transfer``: the CuPy engine's store and load GB/s against one large pinned
   ``cudaMemcpyAsync`` of the same bytes (target >= 0.8x), per copy path: DMA batch,
   DMA 2-D, one DMA copy per range, the SM kernel.
5. ``decode_latency``: a memory-bound decode-like step on the compute stream, alone and
   while large stores and loads run in DMA and kernel mode (how much each slows it).
6. ``calibration``: DMA vs kernel per range count and size, stores and loads.
7. ``startup``: a CuPy engine built (and a copy made) with HOME unwritable and no
   ``CUPY_CACHE_DIR``, in a child process.
8. ``layer_overlap``: a same-step load per layer against one fenced whole and none, under
   a fake forward of 16 layers (``kv_offload.testing.layer_overlap``): the forward's
   time each way, the share of the load's cost that per-layer waits hide, and every byte
   each layer read and each block loaded (mismatches must be 0).

    python -m kv_offload.testing.gpu_check --out gpu-check   # (benchmarks/gpu_check.sh)

Importing this module imports nothing beyond the standard library: the parts import
torch, CuPy and kv-offload's modules when they run, after ``stub_missing``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_offload.copy.cupy_engine import CupyCopyEngine

REPO = Path(__file__).resolve().parents[2]  # the working tree: tests/copy lives there


def stub_missing(names: tuple[str, ...] = ("xxhash",)) -> list[str]:
    """Stand-ins for optional packages that kv-offload's modules import but these checks
    never call (checksums of the disk and remote tiers): using one raises. Puts them in
    ``sys.modules``; returns the names stubbed (those not installed)."""
    import types

    stubbed = []
    for name in names:
        if importlib.util.find_spec(name) is not None:
            continue
        module = types.ModuleType(name)

        def missing(attr: str, name: str = name) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)

            def fail(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(f"{name} is not installed on this machine")
            return fail

        module.__getattr__ = missing  # type: ignore[method-assign]
        sys.modules[name] = module
        stubbed.append(name)
    return stubbed


def environment() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name(0)
    try:
        from kv_offload.copy.cuda_runtime import cupy_cache_dir

        cupy_cache_dir()  # as kv-offload imports CuPy: a kernel cache it can write
        import cupy

        out["cupy"] = cupy.__version__
        out["nvrtc"] = _nvrtc()
    except Exception as exc:  # CudaUnavailableError: CuPy missing or not importable
        out["cupy"] = f"missing ({exc})"
    out["optional"] = {m: _installed(m)
                       for m in ("pytest", "lmdb", "xxhash", "numba", "psutil", "vllm")}
    missing = [what for what, bad in (("CuPy", out["cupy"].startswith("missing")),
                                      ("CUDA device", not out["cuda_available"])) if bad]
    out["ok"] = not missing
    if missing:
        out["why"] = f"no {' and no '.join(missing)}: the CUDA path cannot be checked"
    else:
        from kv_offload.copy.dma import load_driver

        torch.zeros(1, device="cuda")  # a context, for the priority range
        driver = load_driver()
        out["driver"] = {"version": driver.version, "batch_copy": driver.batch is not None,
                         "why_no_batch": driver.why_no_batch,
                         "stream_priorities": [driver.least_priority, driver.greatest_priority]}
    return out


def _nvrtc() -> str:
    """NVRTC's version, or why kernel mode is skipped: the tile kernel needs it."""
    from kv_offload.copy.cuda_runtime import nvrtc_version

    version = nvrtc_version()
    return "missing: kernel mode skipped" if version is None else f"{version[0]}.{version[1]}"


PATHS = ("batch", "2d", "ranges", "kernel")


def _paths() -> tuple[str, ...]:
    """The copy paths to measure: without NVRTC, kernel mode cannot be built; without a
    12.8 driver, there is no batch copy."""
    from kv_offload.copy.cuda_runtime import nvrtc_version
    from kv_offload.copy.dma import load_driver

    return tuple(p for p in PATHS if (p != "kernel" or nvrtc_version())
                 and (p != "batch" or load_driver().batch is not None))


def make_engine(planes: list[Any], host: Any, bpc: int, path: str) -> CupyCopyEngine:
    """A CuPy engine that copies with ``path``: "batch" (DMA, the default where the
    driver has it), "2d" (DMA as on drivers before 12.8), "ranges" (one DMA copy per
    range, the audit's fall back) or "kernel"."""
    import dataclasses

    from kv_offload.copy.cupy_engine import CupyCopyEngine
    from kv_offload.copy.dma import load_driver

    if path == "kernel":
        return CupyCopyEngine(planes, host, bpc, device=0, mode="kernel")
    driver = load_driver()
    if path != "batch":
        driver = dataclasses.replace(driver, batch=None, why_no_batch="not asked for")
    engine = CupyCopyEngine(planes, host, bpc, device=0, mode="dma", driver=driver)
    if path == "ranges":
        engine.fall_back_to_plainest()
    return engine


def _installed(name: str) -> bool:
    """Whether ``name`` is really installed: a ``stub_missing`` stand-in is not (and
    ``importlib.util.find_spec`` raises ValueError for it: it has no ``__spec__``)."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is None:
        return False
    return importlib.util.find_spec(name) is not None


def cuda_tests(timeout_s: int) -> dict[str, Any]:
    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not installed"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/copy/test_cupy_engine.py", "tests/copy/test_host_buffer.py",
           "tests/copy/test_cupy_api.py", "tests/copy/test_dma.py"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    passed = re.search(r"(\d+) passed", tail[-1] if tail else "")
    # all skipped (no CuPy, no device) is no check at all
    return {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "tail": tail,
            "ok": proc.returncode == 0 and passed is not None and int(passed.group(1)) > 0}


STEP_LOOP_CASES: dict[str, dict[str, Any]] = {
    "v1": {"runner": "v1"},
    "v2": {"runner": "v2"},
    # (V2 with new blocks zeroed before the fence races the copies: such engines, mamba
    # or mixed precisions, are refused at start-up, engine_info.layout_from_vllm)
    "audit": {"runner": "v1", "audit_rate": 1.0},
    # synchronous scheduling, CPU-tier hits loaded in their step, each layer waiting for
    # its own copies (issue 29)
    "same_step_v1": {"runner": "v1", "same_step": True},
    "same_step_v2": {"runner": "v2", "same_step": True},
}


def step_loop(steps: int, forward_ms: float) -> dict[str, Any]:
    import torch

    from kv_offload.testing.step_loop import run_step_loop

    cycles = int(forward_ms * _sleep_cycles_per_ms())
    out: dict[str, Any] = {"forward_ms": forward_ms, "cases": {}}
    for name, kwargs in STEP_LOOP_CASES.items():
        side = torch.cuda.Stream()  # the forward runs on a stream of its own, as with TP > 1
        with torch.cuda.stream(side):
            case = run_step_loop("cuda", steps=steps, seed=7, slow_forward_cycles=cycles,
                                 **kwargs)
        case["ok"] = (case["mismatches"] == 0 and case["stored_mismatches"] == 0
                      and case["audit_mismatches"] == 0
                      and (case["same_step_loads"] > 0 or not kwargs.get("same_step")))
        out["cases"][name] = case
    out["ok"] = all(case["ok"] for case in out["cases"].values())
    return out


def _sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on this GPU."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def _time_pair(run_ours, run_base, reps: int) -> tuple[float, float]:
    """Best seconds of each, interleaved."""
    ours: list[float] = []
    base: list[float] = []
    for _ in range(reps):
        for fn, sink in ((run_ours, ours), (run_base, base)):
            t0 = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - t0)
    return min(ours), min(base)


def _flash_attention_job(num_blocks: int, bpc: int, layers: int, num_chunks: int) -> Any:
    """KV tensors of a FlashAttention-like layout (K and V planes per layer, 16 KiB per
    block and plane), pinned host slots for ``num_chunks`` chunks and a shuffled job."""
    import numpy as np
    import torch

    from kv_offload.copy.host_buffer import allocate_host_slots
    from kv_offload.copy.planes import planes_from_kv_tensor

    tensors = [torch.randint(0, 256, (2, num_blocks, 16, 8, 128), dtype=torch.uint8,
                             device="cuda").view(torch.bfloat16) for _ in range(layers)]
    planes = [p for t in tensors for p in planes_from_kv_tensor(t, num_blocks)]
    slot_bytes = sum(p.shape[1] for p in planes) * bpc
    host = allocate_host_slots(num_chunks, slot_bytes, pinned=True)
    ids = np.random.default_rng(0).permutation(num_blocks)[: num_chunks * bpc]
    return tensors, planes, host, ids.reshape(num_chunks, bpc), np.arange(num_chunks)


def transfer(reps: int) -> dict[str, Any]:
    """Chunks of 2 MiB (8 blocks of 8 layers' K and V planes, 16 KiB each) through each
    copy path, against one pinned cudaMemcpyAsync of the same total bytes."""
    import cupy
    import numpy as np
    import torch

    num_blocks, bpc, n = 2048, 8, 64
    _, planes, host, shuffled, slots = _flash_attention_job(num_blocks, bpc, 8, n)
    total = n * host.slot_bytes
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = cupy.cuda.Stream(non_blocking=True)
    out: dict[str, Any] = {"chunk_bytes": host.slot_bytes, "total_bytes": total, "cases": []}
    for pattern in ("contiguous", "shuffled"):
        ids = np.arange(n * bpc).reshape(n, bpc) if pattern == "contiguous" else shuffled
        for path in _paths():
            engine = make_engine(planes, host, bpc, path)
            for direction in ("store", "load"):
                def ours(engine=engine, direction=direction, ids=ids):
                    h = (engine.store(ids, slots) if direction == "store"
                         else engine.load(slots, ids))
                    engine.wait(h)

                def base(direction=direction):
                    src, dst = ((dev.data_ptr(), host.as_tensor().data_ptr()) if direction == "store"
                                else (host.as_tensor().data_ptr(), dev.data_ptr()))
                    cupy.cuda.runtime.memcpyAsync(dst, src, total, 4, stream.ptr)
                    stream.synchronize()

                ours(), base()
                t_ours, t_base = _time_pair(ours, base, reps)
                out["cases"].append({
                    "pattern": pattern, "path": path, "direction": direction,
                    "ours_gbps": round(total / t_ours / 1e9, 2),
                    "memcpy_gbps": round(total / t_base / 1e9, 2),
                    "ratio": round(t_base / t_ours, 3)})
            engine.close()
    default = [c["ratio"] for c in out["cases"] if c["path"] == _paths()[0]]
    out["target"] = "the default (DMA) path >= 0.8x one pinned cudaMemcpyAsync"
    out["target_met"] = min(default) >= 0.8  # a speed target: reported, not a failure
    return out


def decode_latency(steps: int) -> dict[str, Any]:
    """How much large stores and loads slow a decode-like step on the compute stream (40
    small-batch matmuls that each read 32 MiB of weights: memory-bound, under a
    millisecond): alone, then while a thread copies 64 chunks of 2 MiB back and forth
    with each copy path (the kernel's CTAs compete for SMs, DMA only for memory)."""
    import threading

    import torch

    _, planes, host, ids, slots = _flash_attention_job(2048, 8, 8, 64)
    x = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")
    weights = [torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda") for _ in range(4)]

    def decode_steps() -> list[float]:
        times = []
        for _ in range(steps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(40):
                x.copy_((x @ weights[i % 4]).clamp_(-1, 1))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    decode_steps()  # warm up
    rows: dict[str, Any] = {"alone": _percentiles(decode_steps())}
    for path in [p for p in ("batch", "2d", "kernel") if p in _paths()]:
        engine = make_engine(planes, host, 8, path)
        stop, copied = threading.Event(), [0]

        def copy_loop(engine=engine, stop=stop, copied=copied) -> None:
            while not stop.is_set():
                engine.wait(engine.store(ids, slots))
                engine.wait(engine.load(slots, ids))
                copied[0] += 2 * len(slots) * host.slot_bytes

        thread = threading.Thread(target=copy_loop, name=f"gpu-check-{path}")
        start = time.perf_counter()
        thread.start()
        try:
            times = decode_steps()
        finally:
            stop.set()
            thread.join()
        row = _percentiles(times)
        row["p50_vs_alone"] = round(row["p50_ms"] / rows["alone"]["p50_ms"], 3)
        row["copy_gbps"] = round(copied[0] / (time.perf_counter() - start) / 1e9, 1)
        rows[path] = row
        engine.close()
    return rows


def _percentiles(times_ms: list[float]) -> dict[str, Any]:
    ordered = sorted(times_ms)
    return {"p50_ms": round(ordered[len(ordered) // 2], 3),
            "p90_ms": round(ordered[int(len(ordered) * 0.9)], 3)}


def calibration(reps: int) -> dict[str, Any]:
    """DMA (the default path) vs kernel mode for ranges of one size, per count and size
    and direction: where, if anywhere, the kernel is faster on an idle GPU
    (``decode_latency`` says what it costs the forward)."""
    import numpy as np
    import torch

    from kv_offload.copy.host_buffer import allocate_host_slots

    if "kernel" not in _paths():
        return {"skipped": "no NVRTC: kernel mode cannot be built"}
    dma = _paths()[0]
    rows = []
    for range_kib in (16, 256, 4096):
        plane_bytes = range_kib << 10
        for count in (16, 256):
            num_blocks = 2 * count
            plane = torch.zeros((num_blocks, plane_bytes), dtype=torch.uint8, device="cuda")
            host = allocate_host_slots(count, plane_bytes, pinned=True)
            ids = np.random.default_rng(1).permutation(num_blocks)[:count].reshape(count, 1)
            slots = np.arange(count)
            for direction in ("store", "load"):
                times: dict[str, float] = {}
                for path in (dma, "kernel"):
                    engine = make_engine([plane], host, 1, path)

                    def once(engine=engine, direction=direction, ids=ids,
                             slots=slots) -> None:
                        engine.wait(engine.store(ids, slots) if direction == "store"
                                    else engine.load(slots, ids))

                    once()
                    best = float("inf")
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        once()
                        best = min(best, time.perf_counter() - t0)
                    times[path] = best
                    engine.close()
                rows.append({"range_kib": range_kib, "ranges": count, "direction": direction,
                             "dma_us": round(times[dma] * 1e6, 1),
                             "kernel_us": round(times["kernel"] * 1e6, 1),
                             "winner": "kernel" if times["kernel"] < times[dma] else "dma"})
            del plane, host
    return {"dma_path": dma, "rows": rows}


STARTUP_CODE = """
import numpy as np, torch
from kv_offload.copy.cupy_engine import CupyCopyEngine
from kv_offload.copy.cuda_runtime import nvrtc_version
from kv_offload.copy.host_buffer import allocate_host_slots
plane = torch.randint(0, 256, (8, 4096), dtype=torch.uint8, device="cuda")
host = allocate_host_slots(2, 8192, pinned=True)
for mode in ("dma", "kernel") if nvrtc_version() else ("dma",):
    engine = CupyCopyEngine([plane], host, 2, device=0, mode=mode)
    engine.wait(engine.store(np.array([[3, 5]]), np.array([1])))
    assert torch.equal(host.as_tensor()[1].cuda().view(2, 4096), plane[[3, 5]]), mode
    engine.close()
print("started", mode)
"""


def startup(timeout_s: int) -> dict[str, Any]:
    """Build engines (kernel mode compiles through CuPy's kernel cache) with HOME a file
    that is no directory and no CUPY_CACHE_DIR, as random-UID containers run."""
    env = {k: v for k, v in os.environ.items() if k != "CUPY_CACHE_DIR"}
    env["HOME"] = "/dev/null"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", STARTUP_CODE], cwd="/", env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
    return {"returncode": proc.returncode, "tail": tail, "ok": proc.returncode == 0}


def layer_overlap() -> dict[str, Any]:
    from kv_offload.testing.layer_overlap import layer_overlap as measure

    return measure(device="cuda", reps=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--steps", type=int, default=200, help="step-loop steps per case")
    parser.add_argument("--forward-ms", type=float, default=20.0,
                        help="simulated forward of the step loop (10-50 ms in real runs)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"stubbed_missing_packages": stub_missing()}
    parts = [("environment", environment), ("cuda_tests", lambda: cuda_tests(100)),
             ("step_loop", lambda: step_loop(args.steps, args.forward_ms)),
             ("transfer", lambda: transfer(args.reps)),
             ("decode_latency", lambda: decode_latency(50)),
             ("calibration", lambda: calibration(args.reps)),
             ("startup", lambda: startup(60)), ("layer_overlap", layer_overlap)]
    for name, part in parts:
        start = time.perf_counter()
        try:
            results[name] = part()
        except Exception as exc:  # one part failing must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc().splitlines()[-8:]}
        results[name + "_s"] = round(time.perf_counter() - start, 1)
        print(f"== {name}: {json.dumps(results[name])[:2000]}", flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    failed = [n for n, _ in parts if "error" in results[n] or results[n].get("ok") is False
              or results[n].get("returncode", 0) != 0]
    speed = results["transfer"].get("target_met")
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'OK'} (bytes, errors, "
          f"tests); speed target {'n/a' if speed is None else 'met' if speed else 'MISSED'} "
          f"(results in {args.out / 'gpu_check.json'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
