"""DMA copies for the CuPy engine: one call's byte ranges in as few copy calls as the
driver and the layout allow, on the GPU's copy engines (no SMs, so a copy never takes
them from the forward).

Three paths, best first; ``DmaCopier.path`` says which one runs:

- ``"batch"``: one ``cuMemcpyBatchAsync`` per call, whatever the number of ranges (the
  driver API of CUDA 12.8+ drivers, called through ctypes on CuPy's raw stream handle;
  what vLLM's own offloading connectors use). Found at start-up (``load_driver``); a
  driver without it, or a batch call that fails, falls back to the next path.
- ``"2d"``: one ``cudaMemcpy2DAsync`` per group of consecutive ranges of one size at a
  constant source and destination pitch (``plan.strided_groups``, in plane-major or
  run-major order, whichever gives fewer groups): one call per plane and run for planes
  with padded rows, one per plane for chunks stored from consecutive blocks into
  consecutive slots; ``cudaMemcpyAsync`` for a group of one.
- ``"ranges"``: one ``cudaMemcpyAsync`` per range, the plainest; where the runtime audit
  sends an engine whose copy it found wrong.

Sources are read in stream order (``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``) in both
directions: vLLM reads pinned host memory for loads with ``ANY`` (earlier, a possible
gain), which is only safe while nothing writes that slot before the copy's stream turn;
not taken without a GPU measurement.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kv_offload.copy.plan import strided_groups

__all__ = ["BATCH_MIN_DRIVER", "DmaCopier", "DriverInfo", "load_driver"]

logger = logging.getLogger(__name__)

BATCH_MIN_DRIVER = 12080
"""``cuMemcpyBatchAsync`` came with the CUDA 12.8 driver (``cuDriverGetVersion``)."""
MAX_PITCH = (1 << 31) - 1
"""Largest pitch handed to ``cudaMemcpy2DAsync`` (``cudaDevAttrMaxPitch`` is 2^31-1 on
every NVIDIA GPU so far); ranges further apart go one per call."""
SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault

# cuMemcpyBatchAsync as the CUDA 12.8 driver exports it (the unversioned symbol keeps
# that ABI; CUDA 13 headers name the one without failIdx ``cuMemcpyBatchAsync_v2``):
# (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream) -> CUresult
BatchMemcpy = Callable[[int, int, int, int, int, int, int, int, int], int]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (24 bytes)."""

    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


@dataclass(frozen=True, slots=True)
class DriverInfo:
    """What the CUDA driver offers the engine: its version (0 unknown), the batch copy
    (None, and ``why_no_batch``, where it has none) and the stream priorities, lowest
    first: ``least_priority`` is the one copy streams get."""

    version: int
    batch: BatchMemcpy | None
    why_no_batch: str
    least_priority: int
    greatest_priority: int


def load_driver(lib: Any = None) -> DriverInfo:
    """Ask the CUDA driver (``libcuda.so.1``, or ``lib``) for its version, the batch copy
    and the stream priority range of the current context. Never raises: what cannot be
    told is reported as missing (priorities 0, CUDA's default and least priority)."""
    try:
        lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return DriverInfo(0, None, f"libcuda.so.1 cannot be loaded ({exc})", 0, 0)
    version = ctypes.c_int(0)
    try:
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            version.value = 0
    except AttributeError:
        version.value = 0
    least, greatest = ctypes.c_int(0), ctypes.c_int(0)
    try:
        if lib.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)) != 0:
            least.value = greatest.value = 0
    except AttributeError:
        least.value = greatest.value = 0
    batch, why = None, ""
    if version.value < BATCH_MIN_DRIVER:
        why = f"driver {_version_text(version.value)} < 12.8"
    else:
        try:
            fn = lib.cuMemcpyBatchAsync
        except AttributeError:
            why = "the driver exports no cuMemcpyBatchAsync"
        else:
            fn.restype = ctypes.c_uint
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_void_p]
            batch = fn
    return DriverInfo(version.value, batch, why, least.value, greatest.value)


def _version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}" if version else "unknown"


class DmaCopier:
    """Issues byte ranges as DMA copies on a stream (see the module docstring).

    ``runtime``: ``cupy.cuda.runtime`` (``memcpyAsync``, ``memcpy2DAsync``); ``batch``:
    ``DriverInfo.batch``. ``issue`` may run on several threads at once (one per
    direction); the path only ever moves down (batch -> 2d -> ranges).
    """

    def __init__(self, runtime: Any, batch: BatchMemcpy | None) -> None:
        self._rt = runtime
        self._batch = batch
        self._path = "batch" if batch is not None else "2d"
        self._lock = threading.Lock()
        self._attrs = MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self._attr_index = (ctypes.c_size_t * 1)(0)

    @property
    def path(self) -> str:
        return self._path

    def fall_back_to_plainest(self) -> bool:
        """One ``cudaMemcpyAsync`` per range from now on; False if already so."""
        with self._lock:
            if self._path == "ranges":
                return False
            self._path = "ranges"
            return True

    def issue(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, stream: int, *,
              host_is_src: bool) -> int:
        """Queue copies of ``nbytes[k]`` bytes from ``src[k]`` to ``dst[k]`` (int64 device
        or host addresses) on ``stream``; returns how many copy calls it made. Raises what
        CUDA raises (a failed batch call is retried by the next path first).
        ``host_is_src``: which side is the host slot buffer (the 2-D path also tries the
        ranges in host order)."""
        if nbytes.shape[0] == 0:
            return 0
        if self._path == "batch":
            try:
                return self._issue_batch(src, dst, nbytes, stream)
            except _BatchError as exc:
                with self._lock:
                    if self._path == "batch":
                        self._path = "2d"
                logger.warning("kv-offload: cuMemcpyBatchAsync failed (%s); copying with "
                               "cudaMemcpy2DAsync from now on", exc)
                # The copies it queued before failing copy the same bytes again: harmless.
        if self._path == "2d":
            return self._issue_2d(src, dst, nbytes, stream, src if host_is_src else dst)
        return self._issue_ranges(src, dst, nbytes, stream)

    def _issue_batch(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                     stream: int) -> int:
        batch = self._batch
        if batch is None:  # never: the path is "batch" only with one
            raise _BatchError("no cuMemcpyBatchAsync")
        dsts = np.ascontiguousarray(dst, dtype=np.uint64)
        srcs = np.ascontiguousarray(src, dtype=np.uint64)
        sizes = np.ascontiguousarray(nbytes, dtype=np.uint64)  # size_t on 64-bit Linux
        fail_index = ctypes.c_size_t(0)
        err = batch(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data,
                          int(sizes.shape[0]), ctypes.addressof(self._attrs),
                          ctypes.addressof(self._attr_index), 1,
                          ctypes.addressof(fail_index), int(stream))
        if err != 0:
            raise _BatchError(f"CUresult {err} at copy {fail_index.value} of {sizes.shape[0]}")
        return 1

    def _issue_2d(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                  stream: int, host: np.ndarray) -> int:
        # Ranges come plane-major (a plane's runs in a row: one group per plane when
        # consecutive blocks go to consecutive slots); in host order they come run-major
        # (a run's planes in a row: K and V of a layer, or every layer where vLLM
        # allocated them at one pitch). Whichever gives fewer calls.
        groups = strided_groups(src, dst, nbytes, max_pitch=MAX_PITCH)
        if groups.num_groups > 1:
            order = np.argsort(host, kind="stable")
            alt = strided_groups(src[order], dst[order], nbytes[order], max_pitch=MAX_PITCH)
            if alt.num_groups < groups.num_groups:
                groups = alt
        memcpy_async, memcpy_2d = self._rt.memcpyAsync, self._rt.memcpy2DAsync
        columns = zip(groups.src.tolist(), groups.dst.tolist(), groups.width.tolist(),
                      groups.height.tolist(), groups.src_pitch.tolist(),
                      groups.dst_pitch.tolist())
        for s, d, width, height, spitch, dpitch in columns:
            if height == 1:
                memcpy_async(d, s, width, MEMCPY_DEFAULT, stream)
            else:
                memcpy_2d(d, dpitch, s, spitch, width, height, MEMCPY_DEFAULT, stream)
        return groups.num_groups

    def _issue_ranges(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                      stream: int) -> int:
        memcpy_async = self._rt.memcpyAsync
        for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist()):
            memcpy_async(d, s, n, MEMCPY_DEFAULT, stream)
        return int(nbytes.shape[0])


class _BatchError(RuntimeError):
    """cuMemcpyBatchAsync returned an error."""
