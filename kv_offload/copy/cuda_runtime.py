"""CUDA through CuPy, outside the copy engine: is CUDA usable here, which NVRTC, pinned
and mapped host memory, and the device address of such memory.

CuPy is imported on first use, so this module imports cleanly without it; only
``alloc_pinned_host`` raises ``CudaUnavailableError`` (and ``cuda_module`` for callers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kv_offload.copy.base import CudaUnavailableError, InsufficientHostMemoryError

__all__ = ["alloc_pinned_host", "cuda_available", "cuda_module", "device_address",
           "nvrtc_version"]

# CUDA enums as the CUDA headers define them (``tests/copy/test_cupy_api.py`` checks them
# against CuPy's ``cupy.cuda.runtime`` constants where CuPy is installed).
HOST_ALLOC_PORTABLE = 0x01  # cudaHostAllocPortable: usable from every context
HOST_ALLOC_MAPPED = 0x02  # cudaHostAllocMapped: addressable by kernels
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses
MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise CudaUnavailableError(
            "kv-offload needs CuPy for CUDA KV caches and pinned host memory; install "
            "kv-offload[cuda12] or kv-offload[cuda13]") from exc
    return cupy


def cuda_module() -> Any:
    """CuPy, once CUDA answers with at least one device; else CudaUnavailableError
    (CuPy installed on a host without a GPU or driver says why: no device, driver too old)."""
    cp = _cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as exc:
        raise CudaUnavailableError(f"CuPy is installed but CUDA is not usable here: {exc}") from exc
    if count < 1:
        raise CudaUnavailableError("CuPy is installed but CUDA reports no device")
    return cp


def cuda_available() -> bool:
    """Whether CuPy imports and sees at least one CUDA device (``cuda_module``). Never
    raises."""
    try:
        cuda_module()
    except Exception:
        return False
    return True


def nvrtc_version() -> tuple[int, int] | None:
    """The NVRTC version CuPy loads (the tile-copy kernel of ``kernel`` mode is compiled
    with it), or None when it cannot be loaded: ``auto`` then copies with
    cudaMemcpyAsync only and ``kernel`` mode is refused. Never raises."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
        return int(major), int(minor)
    except Exception:
        return None


def alloc_pinned_host(nbytes: int) -> tuple[np.ndarray, object]:
    """Allocate exactly ``nbytes`` of page-locked, portable, CUDA-mapped host memory.

    Returns a writable uint8 numpy array over it and the owning allocation (freed when
    neither it nor the array is referenced any more). Raises CudaUnavailableError
    without CuPy or a device, InsufficientHostMemoryError when CUDA refuses the size.
    """
    cp = cuda_module()
    try:
        mem = cp.cuda.PinnedMemory(int(nbytes), HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
    except cp.cuda.runtime.CUDARuntimeError as exc:
        if "MemoryAllocation" in str(exc):
            raise InsufficientHostMemoryError(
                f"cannot pin {nbytes} bytes of host memory ({exc}); lower cpu_size in the "
                "offload config") from None
        raise CudaUnavailableError(f"cannot allocate pinned host memory: {exc}") from exc
    array = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), dtype=np.uint8, count=int(nbytes))
    return array, mem


def device_address(cp: Any, host_ptr: int) -> int:
    attrs = cp.cuda.runtime.pointerGetAttributes(host_ptr)
    if getattr(attrs, "type", MEMORY_TYPE_HOST) != MEMORY_TYPE_HOST or not attrs.devicePointer:
        raise ValueError("host memory is not pinned and mapped for CUDA; allocate it with "
                         "allocate_host_slots(..., pinned=True)")
    return int(attrs.devicePointer)
