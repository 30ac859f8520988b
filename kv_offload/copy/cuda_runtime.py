"""CUDA through CuPy, outside the copy engine: is CUDA usable here, which NVRTC, pinned
and mapped host memory, and the device address of such memory.

CuPy is imported on first use, so this module imports cleanly without it; only
``alloc_pinned_host`` raises ``CudaUnavailableError`` (and ``cuda_module`` for callers).
Before that import, ``cupy_cache_dir`` chooses where CuPy keeps compiled kernels: CuPy
creates ``~/.cupy/kernel_cache`` while it imports and fails there under an unwritable or
non-directory HOME (random-UID containers, ``nobody``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import tempfile
from collections.abc import MutableMapping
from typing import Any

import numpy as np

from kv_offload.copy.base import CudaUnavailableError, InsufficientHostMemoryError

__all__ = ["alloc_pinned_host", "cuda_available", "cuda_module", "cupy_cache_dir",
           "device_address", "nvrtc_version"]

logger = logging.getLogger(__name__)
CUPY_CACHE_ENV = "CUPY_CACHE_DIR"

# CUDA enums as the CUDA headers define them (``tests/copy/test_cupy_api.py`` checks them
# against CuPy's ``cupy.cuda.runtime`` constants where CuPy is installed).
HOST_ALLOC_PORTABLE = 0x01  # cudaHostAllocPortable: usable from every context
HOST_ALLOC_MAPPED = 0x02  # cudaHostAllocMapped: addressable by kernels
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses
MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost


def cupy_cache_dir(environ: MutableMapping[str, str] = os.environ) -> str:
    """Choose a writable directory for CuPy's kernel cache and name it in ``environ``'s
    ``CUPY_CACHE_DIR`` (which CuPy reads when it is imported): one set already is kept as
    it is; else ``~/.cupy/kernel_cache`` when it is, or can be made, a writable directory;
    else ``kv-offload-cupy-<uid>`` under ``tempfile.gettempdir()``, made private to this
    user (an existing one must be a directory of this user that no one else may write:
    CuPy loads the kernels it finds there). Returns the directory; CudaUnavailableError
    naming what was tried when none is usable."""
    chosen = environ.get(CUPY_CACHE_ENV)
    if chosen:
        return chosen
    tried = []
    home = os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    try:
        os.makedirs(home, exist_ok=True)
        if not os.access(home, os.W_OK | os.X_OK):
            raise PermissionError(f"{home} is not writable")
    except OSError as exc:
        tried.append(f"{home}: {exc}")
    else:
        environ[CUPY_CACHE_ENV] = home
        return home
    try:
        private = os.path.join(tempfile.gettempdir(), f"kv-offload-cupy-{os.getuid()}")
        _make_private_dir(private)
    except OSError as exc:
        tried.append(str(exc))
    else:
        logger.info("kv-offload: CuPy's kernel cache goes to %s (%s)", private, tried[0])
        environ[CUPY_CACHE_ENV] = private
        return private
    raise CudaUnavailableError(
        "kv-offload finds no writable directory for CuPy's kernel cache (" + "; ".join(tried)
        + f"); set {CUPY_CACHE_ENV} to a writable directory, or HOME to a writable home")


def _make_private_dir(path: str) -> None:
    """Create ``path`` with mode 0700, or check that an existing one is a directory (not a
    link) of this user that neither group nor others may write; OSError otherwise."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(f"{path} is not a directory private to this user "
                              f"(mode {stat.filemode(info.st_mode)}, owner uid {info.st_uid})")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{path} is not writable")


def _cupy() -> Any:
    if "cupy" not in sys.modules:
        cupy_cache_dir()
    try:
        import cupy
    except ImportError as exc:
        raise CudaUnavailableError(
            "kv-offload needs CuPy for CUDA KV caches and pinned host memory; install "
            "kv-offload[cuda12] or kv-offload[cuda13]") from exc
    except OSError as exc:  # its kernel cache directory (CUPY_CACHE_DIR as set)
        raise CudaUnavailableError(
            f"CuPy failed to import ({exc}); set {CUPY_CACHE_ENV} to a writable "
            f"directory (now {os.environ.get(CUPY_CACHE_ENV)!r})") from exc
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
    with it), or None when it cannot be loaded. The engine does not ask: it compiles the
    kernel when ``kernel`` mode is chosen, so a missing NVRTC fails then; the GPU check
    (``testing/gpu_check.py``) and the tests ask, to skip that mode. Here because every
    CuPy call is. Never raises."""
    try:
        _cupy()
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
