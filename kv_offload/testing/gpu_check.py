"""kv-offload's CUDA path end to end on one GPU, offline, in a few minutes.

Runs from the working tree with what a GPU machine has (torch and CuPy; no vLLM, no
package index; pytest, lmdb, xxhash, numba, psutil optional: what is missing is skipped
and said so). Each part writes into one JSON file:

1. ``environment``: torch, CUDA, CuPy, the device.
2. ``cuda_tests``: the CUDA tests of the copy engines (pytest -m cuda tests/copy).
3. ``step_loop``: ``kv_offload.testing.step_loop`` on CUDA: vLLM's order of calls under
   async scheduling, the forward on a side stream that runs behind the host, blocks
   reused at once, every loaded and stored byte compared (mismatches must be 0).
4. ``transfer``: the CuPy engine's store and load GB/s against one large pinned
   ``cudaMemcpyAsync`` of the same bytes (target >= 0.8x), DMA and kernel modes.
5. ``calibration``: DMA vs kernel mode per range count and size.

    python -m kv_offload.testing.gpu_check --out gpu-check   # (benchmarks/gpu_check.sh)

Importing this module imports nothing beyond the standard library: the parts import
torch, CuPy and kv-offload's modules when they run, after ``stub_missing``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_offload.copy.cupy_engine import CopyMode

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
        import cupy

        out["cupy"] = cupy.__version__
        out["nvrtc"] = _nvrtc()
    except ImportError as exc:
        out["cupy"] = f"missing ({exc})"
    out["optional"] = {m: _installed(m)
                       for m in ("pytest", "lmdb", "xxhash", "numba", "psutil", "vllm")}
    return out


def _nvrtc() -> str:
    """NVRTC's version, or why kernel mode is skipped: the tile kernel needs it."""
    from kv_offload.copy.cuda_runtime import nvrtc_version

    version = nvrtc_version()
    return "missing: kernel mode skipped" if version is None else f"{version[0]}.{version[1]}"


def _modes() -> tuple[CopyMode, ...]:
    """The copy modes to measure: without NVRTC, kernel mode cannot be built."""
    from kv_offload.copy.cuda_runtime import nvrtc_version

    return ("dma", "kernel", "auto") if nvrtc_version() else ("dma", "auto")


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
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
           "tests/copy/test_cupy_engine.py", "tests/copy/test_host_buffer.py"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "tail": tail}


def step_loop(steps: int) -> dict[str, Any]:
    import torch

    from kv_offload.testing.step_loop import run_step_loop

    side = torch.cuda.Stream()  # the forward runs on a stream of its own, as with TP > 1
    with torch.cuda.stream(side):
        out = run_step_loop("cuda", steps=steps, seed=7, slow_forward_cycles=2_000_000)
    out["ok"] = out["mismatches"] == 0 and out["stored_mismatches"] == 0
    return out


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


def transfer(reps: int) -> dict[str, Any]:
    """Chunks of 2 MiB (FlashAttention-like layout: 8 layers x K/V planes) through the
    engine, against one pinned cudaMemcpyAsync of the same total bytes."""
    import cupy
    import numpy as np
    import torch

    from kv_offload.copy.cupy_engine import CupyCopyEngine
    from kv_offload.copy.planes import planes_from_kv_tensor
    from kv_offload.host_buffer import allocate_host_slots

    num_blocks, bpc, layers = 2048, 8, 8
    tensors = [torch.randint(0, 256, (2, num_blocks, 16, 8, 128), dtype=torch.uint8,
                             device="cuda").view(torch.bfloat16) for _ in range(layers)]
    planes = [p for t in tensors for p in planes_from_kv_tensor(t, num_blocks)]
    slot_bytes = sum(p.shape[1] for p in planes) * bpc
    n = 64
    host = allocate_host_slots(n, slot_bytes, pinned=True)
    total = n * slot_bytes
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"chunk_bytes": slot_bytes, "total_bytes": total, "cases": []}
    for pattern in ("contiguous", "shuffled"):
        ids = (np.arange(n * bpc) if pattern == "contiguous"
               else rng.permutation(num_blocks)[: n * bpc]).reshape(n, bpc)
        slots = np.arange(n)
        for mode in _modes():
            engine = CupyCopyEngine(planes, host, bpc, device=0, mode=mode)
            for direction in ("store", "load"):
                def ours(engine=engine, direction=direction, ids=ids, slots=slots):
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
                    "pattern": pattern, "mode": mode, "direction": direction,
                    "ours_gbps": round(total / t_ours / 1e9, 2),
                    "memcpy_gbps": round(total / t_base / 1e9, 2),
                    "ratio": round(t_base / t_ours, 3)})
            engine.close()
    auto = [c["ratio"] for c in out["cases"] if c["mode"] == "auto"]
    out["target"] = "auto mode >= 0.8x one pinned cudaMemcpyAsync"
    out["target_met"] = min(auto) >= 0.8  # a speed target: reported, not a failure
    return out


def calibration(reps: int) -> dict[str, Any]:
    """DMA vs kernel mode for ranges of one size: which wins, per count and size."""
    import numpy as np
    import torch

    from kv_offload.copy.cupy_engine import CupyCopyEngine
    from kv_offload.host_buffer import allocate_host_slots

    if "kernel" not in _modes():
        return {"skipped": "no NVRTC: kernel mode cannot be built, auto uses memcpy only"}
    rows = []
    for range_kib in (16, 64, 256, 1024, 4096):
        plane_bytes = range_kib << 10
        for count in (4, 16, 64, 256):
            num_blocks = max(2 * count, 8)
            plane = torch.zeros((num_blocks, plane_bytes), dtype=torch.uint8, device="cuda")
            host = allocate_host_slots(count, plane_bytes, pinned=True)
            ids = np.random.default_rng(1).permutation(num_blocks)[:count].reshape(count, 1)
            slots = np.arange(count)
            times: dict[str, float] = {}
            for mode in ("dma", "kernel"):
                engine = CupyCopyEngine([plane], host, 1, device=0, mode=mode)
                engine.wait(engine.store(ids, slots))
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    engine.wait(engine.store(ids, slots))
                    best = min(best, time.perf_counter() - t0)
                times[mode] = best
                engine.close()
            rows.append({"range_kib": range_kib, "ranges": count,
                         "dma_us": round(times["dma"] * 1e6, 1),
                         "kernel_us": round(times["kernel"] * 1e6, 1),
                         "winner": min(times, key=times.__getitem__)})
            del plane, host
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--steps", type=int, default=300, help="step-loop steps")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"stubbed_missing_packages": stub_missing()}
    parts = [("environment", environment), ("cuda_tests", lambda: cuda_tests(150)),
             ("step_loop", lambda: step_loop(args.steps)),
             ("transfer", lambda: transfer(args.reps)),
             ("calibration", lambda: calibration(args.reps))]
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
