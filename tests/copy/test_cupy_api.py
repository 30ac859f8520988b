"""The CUDA path's use of CuPy, checked without a GPU wherever CuPy is installed (the CPU
test install adds cupy-cuda12x and NVRTC for this): the CUDA enums the engine passes
are CuPy's, every CuPy call it makes takes its arguments in the order given, and the
tile kernel compiles. None of this needs a device, so a GPU run never finds these first."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from kv_offload.copy import cuda_runtime, cupy_engine

cp = pytest.importorskip("cupy", reason="CuPy is not installed")


def parameters(fn: object) -> list[str]:
    """Parameter names of a CuPy callable: from ``inspect`` for Python code, else from
    the signature Cython embeds as the first line of the docstring."""
    try:
        return [p for p in inspect.signature(fn).parameters if p != "self"]  # type: ignore[arg-type]
    except (TypeError, ValueError):
        pass
    first = (getattr(fn, "__doc__", None) or "").strip().splitlines()[0]
    inside = re.fullmatch(r"[\w.]+\((.*)\)(\s*->.*)?", first.strip())
    assert inside, f"no signature in the docstring of {fn!r}: {first!r}"
    names = []
    for part in inside.group(1).split(","):
        part = part.split("=")[0].strip().lstrip("*")
        if part:
            names.append(part.split()[-1])
    return [n for n in names if n != "self"]


def test_cuda_enums_match_cupys():
    rt = cp.cuda.runtime
    ours = (cuda_runtime.HOST_ALLOC_PORTABLE, cuda_runtime.HOST_ALLOC_MAPPED,
            cuda_runtime.MEMCPY_DEFAULT, cuda_runtime.MEMORY_TYPE_HOST)
    assert ours == (rt.hostAllocPortable, rt.hostAllocMapped, rt.memcpyDefault,
                    rt.memoryTypeHost)


@pytest.mark.parametrize(("name", "leading"), [
    # the engine's and gpu_check's calls, positional arguments in the order they pass them
    ("cuda.runtime.memcpyAsync", ["dst", "src", "size", "kind", "stream"]),
    ("cuda.runtime.memcpy2DAsync",
     ["dst", "dpitch", "src", "spitch", "width", "height", "kind", "stream"]),
    ("cuda.runtime.pointerGetAttributes", ["ptr"]),
    ("cuda.PinnedMemory", ["size", "flags"]),
    ("cuda.PinnedMemoryPointer", ["mem", "offset"]),
    ("cuda.runtime.eventRecord", ["event", "stream"]),
    ("cuda.runtime.streamWaitEvent", ["stream", "event"]),
    ("cuda.Event.record", ["stream"]),
    ("cuda.Stream.wait_event", ["event"]),
    ("RawKernel", ["code", "name"]),
    ("RawKernel.__call__", ["grid", "block", "args"]),
])
def test_cupy_calls_take_the_arguments_we_pass(name, leading):
    fn: object = cp
    for attr in name.split("."):
        fn = getattr(fn, attr)
    assert parameters(fn)[:len(leading)] == leading


@pytest.mark.parametrize(("name", "keywords"), [
    ("cuda.Event", {"block", "disable_timing"}),
    ("cuda.Stream", {"non_blocking", "priority"}),
])
def test_cupy_constructors_take_the_keywords_we_pass(name, keywords):
    fn: object = cp
    for attr in name.split("."):
        fn = getattr(fn, attr)
    assert keywords <= set(parameters(fn))


def test_cupy_has_the_methods_and_fields_we_use():
    assert callable(cp.RawKernel.compile)  # compiled at engine start-up
    assert callable(cp.cuda.Event.synchronize) and hasattr(cp.cuda.Event, "done")
    assert hasattr(cp.cuda.Stream, "done") and callable(cp.cuda.Stream.synchronize)
    assert {"type", "devicePointer"} <= set(dir(cp.cuda.runtime.PointerAttributes))
    assert issubclass(cp.cuda.runtime.CUDARuntimeError, Exception)
    for cls in (cp.cuda.Event, cp.cuda.Stream):  # raw handles, set per instance
        assert re.search(rf"~{cls.__name__}\.ptr \(intptr_t\)", cls.__doc__), cls


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_tile_kernel_compiles_with_nvrtc(arch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        nvrtc.getVersion()
    except Exception as exc:  # the NVRTC library is not installed
        pytest.skip(f"NVRTC is not loadable: {exc}")
    prog = nvrtc.createProgram(cupy_engine._KERNEL_SOURCE, "kvo_copy_tiles.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}"])
    except Exception as exc:
        pytest.fail(f"{exc}\n{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog).decode()
    assert ".entry kvo_copy_tiles(" in ptx


def test_without_a_device_the_engine_says_cuda_is_unusable():
    if cuda_runtime.cuda_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(cuda_runtime.CudaUnavailableError, match="CUDA is not usable|no device"):
        cuda_runtime.alloc_pinned_host(4096)


class FakePinnedMemory:
    """cupy.cuda.PinnedMemory over ordinary memory (no driver): records the flags."""

    flags: list[int] = []

    def __init__(self, size, flags=0):
        FakePinnedMemory.flags.append(flags)
        self._buf = np.zeros(size, np.uint8)
        self.ptr, self.size = self._buf.ctypes.data, size


def test_pinned_host_memory_is_a_writable_view_of_the_allocation(monkeypatch):
    monkeypatch.setattr(cp.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(cp.cuda, "PinnedMemory", FakePinnedMemory)
    FakePinnedMemory.flags.clear()
    array, owner = cuda_runtime.alloc_pinned_host(4096)
    assert array.dtype == np.uint8 and array.nbytes == 4096 and array.flags.writeable
    assert array.ctypes.data == owner.ptr  # no copy: CUDA's pages, CuPy's buffer protocol
    rt = cp.cuda.runtime
    assert FakePinnedMemory.flags == [rt.hostAllocPortable | rt.hostAllocMapped]


def test_pinned_host_memory_refused_by_cuda_names_cpu_size(monkeypatch):
    def out_of_memory(size, flags=0):
        raise cp.cuda.runtime.CUDARuntimeError(2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(cp.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(cp.cuda, "PinnedMemory", out_of_memory)
    with pytest.raises(cuda_runtime.InsufficientHostMemoryError, match="cpu_size"):
        cuda_runtime.alloc_pinned_host(1 << 40)


def test_nvrtc_version_is_the_one_cupy_loads():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        expected = tuple(nvrtc.getVersion())
    except Exception:
        expected = None
    assert cuda_runtime.nvrtc_version() == expected
