"""CuPy copy engine: KV planes on a CUDA device <-> pinned host slots, asynchronously.

The CuPy calls of the copies live in this module, those that ask whether CUDA is usable
or allocate pinned memory in ``cuda_runtime.py``; CuPy is imported on first use, so the
module imports cleanly without it and only ``CupyCopyEngine(...)`` raises
``CudaUnavailableError``. Planning comes from ``plan.py``.

Ordering (per call, all GPU-side, no host synchronisation):

- each direction has its own non-blocking stream, so stores and loads overlap each
  other and the model;
- ``store``/``load`` first record an event on the *compute stream* and make the copy
  stream wait on it, so a store sees every kernel enqueued before the call (the
  finished forward pass) and a load does not overtake earlier work on its blocks. The
  compute stream is resolved per call: ``after``, an event the caller recorded with
  ``compute_mark()`` on vLLM's thread (the copy then waits for the work queued before
  the mark, not for forwards queued while a disk read ran), else the stream current on
  the calling thread (never one captured at construction: vLLM may run forwards on
  another stream later);
- ``fence(handle)`` makes the calling thread's current stream wait for one copy: the
  worker fences only the copies of blocks vLLM may reuse in the next forward (preempted
  requests); finished requests' blocks are held until their copies are done;
- completion is an event per call: ``is_done`` queries it, ``wait`` sleeps on it (a
  blocking-sync event: the worker's I/O threads wait on stores without spinning a core);
- every method that calls CUDA first makes the engine's device current on the calling
  thread and leaves it so (``_use_device``); never ``with cupy.cuda.Device(...)``,
  whose exit sets the thread's previous device again: device 0 on a thread that never
  chose one, and since CUDA 12 ``cudaSetDevice`` creates that device's context
  (pytorch/pytorch#94864), so every rank's copy and I/O threads would put a context on
  GPU 0; and one ``Device`` object keeps a single stack of previous devices for all
  threads, so concurrent calls could leave vLLM's thread on another thread's device.

Copies are DMA copies by default (``mode`` "auto" or "dma"): the GPU's copy engines move
the bytes, no SMs, so they never take compute from the forward; ``dma.py`` issues a
call's ranges as one ``cuMemcpyBatchAsync`` where the driver has it (12.8+), else as few
``cudaMemcpy2DAsync``/``cudaMemcpyAsync`` calls as the layout allows. ``mode="kernel"``
(only where chosen) launches one kernel that copies 64 KiB tiles straight between device
memory and the mapped pinned host buffer: one launch for any number of ranges, but it
runs on SMs, beside the forward. Both copy streams are created at the device's least
stream priority. ``describe()`` says what was chosen (the worker logs it at start-up).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from kv_offload.copy.base import CopyEngine, CopyEngineClosedError, CopyHandle, LayeredCopy
from kv_offload.copy.cuda_runtime import (
    HOST_ALLOC_MAPPED,
    HOST_ALLOC_PORTABLE,
    cuda_module,
    device_address,
)
from kv_offload.copy.dma import DmaCopier, DriverInfo, load_driver
from kv_offload.copy.layers import PlaneLayers, split_by_layer
from kv_offload.copy.plan import (
    ByteRanges,
    Direction,
    SlotLayout,
    check_block_map,
    expand_chunks,
    plan_runs,
    runs_to_byte_ranges,
    split_byte_ranges,
)
from kv_offload.copy.planes import describe_planes

__all__ = ["COPY_MODES", "CopyMode", "CupyCopyEngine"]

logger = logging.getLogger(__name__)

CopyMode = Literal["auto", "dma", "kernel"]
COPY_MODES: tuple[CopyMode, ...] = ("auto", "dma", "kernel")
"""``auto`` is ``dma``: the tile kernel competes with the forward for SMs and is used
only where chosen, until ``benchmarks/gpu_check.sh`` (its ``decode_latency`` part)
shows it better with a forward running."""

KERNEL_TILE_BYTES = 64 << 10
"""Bytes one CUDA thread block copies in ``kernel`` mode."""

_KERNEL_SOURCE = r"""
extern "C" __global__ void kvo_copy_tiles(unsigned long long table_addr) {
    // table: one (src, dst, nbytes) triple of uint64 per thread block
    __shared__ unsigned long long tile[3];
    const unsigned long long* table = (const unsigned long long*)table_addr;
    if (threadIdx.x < 3) {
        tile[threadIdx.x] = table[3ULL * blockIdx.x + threadIdx.x];
    }
    __syncthreads();
    const unsigned long long src = tile[0], dst = tile[1], n = tile[2];
    if (((src | dst | n) & 15ULL) == 0) {
        const int4* s = (const int4*)src;
        int4* d = (int4*)dst;
        const unsigned long long n16 = n >> 4;
        #pragma unroll 4
        for (unsigned long long i = threadIdx.x; i < n16; i += blockDim.x) {
            d[i] = s[i];
        }
    } else {
        const unsigned char* s = (const unsigned char*)src;
        unsigned char* d = (unsigned char*)dst;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            d[i] = s[i];
        }
    }
}
"""
_KERNEL_THREADS = 256


class _Mark:
    """A ``compute_mark()`` token: holds the only reference to its event, so that
    ``release_mark`` destroys the event at once, on the thread that made the engine's
    device current (a CuPy event is destroyed where its last reference goes)."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event: Any = event


@dataclass(slots=True)
class _Pending:
    event: Any  # cupy.cuda.Event recorded after the call's copies
    tables: list[Any]  # kernel range tables to give back to the arena when done


class _TableArena:
    """Reusable pinned, mapped buffers for kernel range tables (power-of-two sizes).
    A buffer is taken per call and given back once that call's event has fired."""

    def __init__(self, cp: Any) -> None:
        self._cp = cp
        self._free: dict[int, list[tuple[Any, np.ndarray, int]]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[Any, np.ndarray, int]:
        """(owner, uint64 array view, device address) of a buffer >= nbytes."""
        size = max(4096, 1 << (int(nbytes) - 1).bit_length())
        with self._lock:
            pool = self._free.get(size)
            if pool:
                return pool.pop()
        cp = self._cp
        mem = cp.cuda.PinnedMemory(size, HOST_ALLOC_PORTABLE | HOST_ALLOC_MAPPED)
        view = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), dtype=np.uint64,
                             count=size // 8)
        return mem, view, device_address(cp, mem.ptr)

    def give_back(self, item: tuple[Any, np.ndarray, int]) -> None:
        with self._lock:
            self._free.setdefault(item[1].nbytes, []).append(item)


def _compile_kernel(cp: Any) -> Any:
    """The tile-copy kernel, compiled now (NVRTC) so a broken toolchain shows at start-up
    (raises)."""
    kernel = cp.RawKernel(_KERNEL_SOURCE, "kvo_copy_tiles")
    compile_now = getattr(kernel, "compile", None)
    if compile_now is not None:
        compile_now()
    else:  # older CuPy: compiled on first attribute access
        _ = kernel.attributes
    return kernel


class CupyCopyEngine(CopyEngine):
    """Copies chunks between CUDA planes and pinned host slots on two CUDA streams.

    Planes and ``host`` are owned by the caller and must outlive the engine. Methods
    are thread-safe and make ``device`` current on the calling thread (left so: the
    worker's threads use no other device). ``compute_stream``: raw ``cudaStream_t``
    that every copy is ordered against (tests); default None: the stream passed as
    ``after`` or current on the calling thread, per call. ``store``/``load`` return after *issuing* the copies;
    the host buffer (store) or the planes (load) are valid once the handle is done.
    """

    def __init__(
        self,
        planes: list[torch.Tensor],
        host: Any,
        blocks_per_chunk: int,
        device: int,
        *,
        compute_stream: int | None = None,
        mode: CopyMode = "auto",
        driver: DriverInfo | None = None,
    ) -> None:
        """Raises CudaUnavailableError without CuPy/CUDA, ValueError for planes not on
        ``device``, unpinned host slots, a slot too small for a chunk, or a bad mode.
        ``driver``: what the CUDA driver offers (default ``dma.load_driver()``)."""
        cp = cuda_module()
        geometry = describe_planes(planes)
        if geometry.device.type != "cuda" or (geometry.device.index or 0) != device:
            raise ValueError(f"CupyCopyEngine(device={device}) got planes on {geometry.device}")
        if not getattr(host, "pinned", False):
            raise ValueError("CupyCopyEngine needs pinned host slots "
                             "(allocate_host_slots(..., pinned=True))")
        if mode not in COPY_MODES:
            raise ValueError(f"mode must be one of {', '.join(COPY_MODES)}, got {mode!r}")
        self.layout = SlotLayout(geometry.plane_bytes, int(blocks_per_chunk), host.slot_bytes)
        self.num_blocks = geometry.num_blocks
        self.num_slots = host.num_slots
        self.mode = mode
        self._cp = cp
        self._device_id = int(device)
        self._row_strides = geometry.row_strides
        self._keepalive = (list(planes), host.tensor)  # the raw pointers below stay valid
        self._plane_ptrs = np.array([p.data_ptr() for p in planes], dtype=np.int64)
        self._host_ptr = int(host.tensor.data_ptr())
        self._use_device()
        self._host_dev_ptr = device_address(cp, self._host_ptr)
        self._fixed_stream = None if compute_stream is None else int(compute_stream)
        driver = driver or load_driver()
        # The least priority (the largest number): the forward's kernels go first.
        self._streams = {d: cp.cuda.Stream(non_blocking=True, priority=driver.least_priority)
                         for d in Direction}
        unordered = cp.cuda.Event(block=False, disable_timing=True)
        unordered.record(self._streams[Direction.LOAD])  # nothing queued yet: done at once
        self._unordered = _Mark(unordered)
        self._dma = DmaCopier(cp.cuda.runtime, driver.batch)
        self._kernel = _compile_kernel(cp) if mode == "kernel" else None
        self._tables = _TableArena(cp)
        self._issue_locks = {d: threading.Lock() for d in Direction}
        self._lock = threading.Lock()  # guards _pending and _closed
        self._pending: dict[int, _Pending] = {}
        self._seq = itertools.count()
        self._closed = False
        how = {"kernel": "the SM tile-copy kernel (chosen)",
               "batch": "cuMemcpyBatchAsync, one call per copy",
               "2d": f"cudaMemcpy2DAsync (no batch copy: {driver.why_no_batch})"}
        self._description = (
            f"CUDA copies mode {mode} -> {how[self.copy_path]}; copy streams at priority "
            f"{driver.least_priority} (device range {driver.least_priority}.."
            f"{driver.greatest_priority})")

    # -- CopyEngine --------------------------------------------------------------------

    def store(self, block_ids: np.ndarray, slots: np.ndarray, *, after: Any = None
              ) -> CopyHandle:
        """Issue engine -> host copies ordered after the work queued before ``after`` (a
        ``compute_mark()`` token, or a raw stream handle: all work queued on it so far),
        default the calling thread's current stream."""
        return self._submit(Direction.STORE, block_ids, slots, after)[0]

    def load(self, slots: np.ndarray, block_ids: np.ndarray, *, after: Any = None
             ) -> CopyHandle:
        """Issue host -> engine copies, ordered like ``store``."""
        return self._submit(Direction.LOAD, block_ids, slots, after)[0]

    def load_by_layer(self, slots: np.ndarray, block_ids: np.ndarray, layers: PlaneLayers,
                      ) -> LayeredCopy:
        """Issue host -> engine copies ordered after the calling thread's current stream,
        layer by layer on the load stream, an event recorded after each layer's copies
        (its mark: ``fence_mark``); one call, so one handle for the whole copy."""
        handle, marks = self._submit(Direction.LOAD, block_ids, slots, None, layers)
        return LayeredCopy(handle, marks)

    def fence_mark(self, mark: object | None) -> None:
        """Make the calling thread's current stream wait (GPU-side) for the copies issued
        before this layer mark; never blocks the host. None or a released mark: nothing."""
        if isinstance(mark, _Mark) and mark.event is not None:
            self._use_device()
            self._cp.cuda.runtime.streamWaitEvent(self._compute_stream(None),
                                                  mark.event.ptr)

    def fence(self, handle: CopyHandle) -> None:
        """Make the calling thread's current stream wait (GPU-side) for this copy;
        never blocks the host. Unknown or retired handles are done: nothing to wait."""
        with self._lock:
            pending = self._pending.get(handle.seq)
        if pending is not None:
            self._use_device()
            self._cp.cuda.runtime.streamWaitEvent(self._compute_stream(None),
                                                  pending.event.ptr)

    def compute_mark(self) -> _Mark:
        """An event recorded now on the calling thread's compute stream (vLLM's thread):
        pass it as ``after`` from another thread, then give it to ``release_mark``."""
        self._use_device()
        event = self._cp.cuda.Event(block=False, disable_timing=True)
        self._cp.cuda.runtime.eventRecord(event.ptr, self._compute_stream(None))
        return _Mark(event)

    def release_mark(self, mark: object | None) -> None:
        """Destroy the mark's event now, on the calling thread with the engine's device
        current (never where the garbage collector happens to run, which could make a
        context on device 0). Idempotent."""
        if isinstance(mark, _Mark) and mark.event is not None:
            self._use_device()
            mark.event = None  # the last reference: cudaEventDestroy here

    def _current_stream(self) -> int:
        """The raw handle of the calling thread's current CUDA stream (or the fixed
        ``compute_stream``)."""
        if self._fixed_stream is not None:
            return self._fixed_stream
        return int(torch.cuda.current_stream(self._device_id).cuda_stream)

    def unordered_mark(self) -> _Mark:
        """A mark recorded on an empty stream (done at once): as ``after``, the copy waits
        for no compute. The engine's own: never give it to ``release_mark``."""
        return self._unordered

    def describe(self) -> str:
        """The mode, the copy path it chose and why, the streams' priority."""
        return self._description

    @property
    def copy_path(self) -> str:
        """"kernel", or the DMA path: "batch", "2d" or "ranges" (``dma.py``)."""
        return "kernel" if self._kernel is not None else self._dma.path

    def fall_back_to_plainest(self) -> str | None:
        """One cudaMemcpyAsync per range from now on (no kernel, batch or 2-D copies)."""
        had_kernel, self._kernel = self._kernel is not None, None
        if self._dma.fall_back_to_plainest() or had_kernel:
            return self.copy_path
        return None

    def _compute_stream(self, after: Any) -> int:
        """The raw handle of the stream to order against: ``after`` or the current one.
        Used through the runtime's handle calls, not wrapped in a CuPy stream object
        (``ExternalStream`` is deprecated since CuPy 14 and would be one object a call)."""
        return self._current_stream() if after is None else int(after)

    def is_done(self, handle: CopyHandle) -> bool:
        """Query the call's event (never blocks). Unknown or retired handles are done."""
        with self._lock:
            pending = self._pending.get(handle.seq)
        if pending is None:
            return True
        self._use_device()
        if not pending.event.done:
            return False
        self._retire(handle.seq)
        return True

    def wait(self, handle: CopyHandle) -> None:
        """Block the calling thread on the call's event (not the whole device)."""
        with self._lock:
            pending = self._pending.get(handle.seq)
        if pending is not None:
            self._use_device()
            pending.event.synchronize()
            self._retire(handle.seq)

    def close(self) -> None:
        """Refuse new copies, then wait for every issued one. Idempotent."""
        for lock in self._issue_locks.values():  # let calls that are issuing finish
            lock.acquire()
        try:
            with self._lock:
                self._closed = True
                seqs = list(self._pending)
        finally:
            for lock in self._issue_locks.values():
                lock.release()
        for seq in seqs:
            self.wait(CopyHandle(seq, Direction.STORE))

    # -- internals ---------------------------------------------------------------------

    def _submit(self, direction: Direction, block_ids: np.ndarray, slots: np.ndarray,
                after: Any, layers: PlaneLayers | None = None
                ) -> tuple[CopyHandle, tuple[_Mark | None, ...]]:
        """Plan and issue one call's copies; with ``layers``, one layer after the other,
        each followed by an event of its own (its mark; None for a layer without copies)."""
        bpc = self.layout.blocks_per_chunk
        bm = expand_chunks(block_ids, slots, blocks_per_chunk=bpc)
        check_block_map(bm, direction, num_engine_blocks=self.num_blocks,
                        num_slots=self.num_slots)
        runs = plan_runs(bm, blocks_per_chunk=bpc,
                         merge_across_slots=self.layout.contiguous_across_slots)
        ranges = runs_to_byte_ranges(runs, self.layout, self._row_strides)
        parts = [ranges] if layers is None else split_by_layer(ranges, layers)
        self._use_device()
        self._retire_done()
        cp = self._cp
        with self._issue_locks[direction]:
            with self._lock:
                if self._closed:
                    raise CopyEngineClosedError("CupyCopyEngine is closed")
            stream = self._streams[direction]
            if isinstance(after, _Mark):  # a compute_mark(): already recorded
                ready = after.event
                if ready is None:
                    raise ValueError("a compute mark was used after release_mark")
            else:
                ready = cp.cuda.Event(block=False, disable_timing=True)
                cp.cuda.runtime.eventRecord(ready.ptr, self._compute_stream(after))
            stream.wait_event(ready)
            tables: list[Any] = []
            marks: list[_Mark | None] = []
            try:
                for part in parts:
                    marks.append(self._issue(direction, part, stream, tables,
                                             mark=layers is not None))
            except BaseException:
                # No handle tracks the copies already queued, and the caller is about to
                # reuse their slots (failed store) or blocks (failed load): let them end.
                with contextlib.suppress(Exception):
                    stream.synchronize()
                raise
            done = cp.cuda.Event(block=True, disable_timing=True)  # wait() sleeps, no spin
            done.record(stream)
            seq = next(self._seq)
            with self._lock:
                self._pending[seq] = _Pending(done, tables)
        return CopyHandle(seq, direction), tuple(marks)

    def _issue(self, direction: Direction, ranges: ByteRanges, stream: Any,
               tables: list[Any], *, mark: bool) -> _Mark | None:
        """Queue ``ranges`` on ``stream`` (kernel range tables go to ``tables``); with
        ``mark`` and ranges, an event recorded after them (a layer's mark), else None."""
        if not ranges.num_ranges:
            return None
        if self._kernel is not None:
            table = self._launch_kernel(direction, ranges, stream)
            if table is not None:
                tables.append(table)
        else:
            self._issue_memcpys(direction, ranges, stream)
        if not mark:
            return None
        event = self._cp.cuda.Event(block=False, disable_timing=True)
        self._cp.cuda.runtime.eventRecord(event.ptr, stream.ptr)
        return _Mark(event)

    def _use_device(self) -> None:
        """Make the engine's device current on the calling thread, and leave it so (see
        the module docstring). ``cudaGetDevice`` creates no context."""
        runtime = self._cp.cuda.runtime
        if runtime.getDevice() != self._device_id:
            runtime.setDevice(self._device_id)

    def _endpoints(self, direction: Direction, ranges: ByteRanges, host_base: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        engine = self._plane_ptrs[ranges.plane] + ranges.engine_offset
        host = host_base + ranges.host_offset
        return (engine, host) if direction is Direction.STORE else (host, engine)

    def _issue_memcpys(self, direction: Direction, ranges: ByteRanges, stream: Any) -> None:
        src, dst = self._endpoints(direction, ranges, self._host_ptr)
        self._dma.issue(src, dst, ranges.nbytes, stream.ptr,
                        host_is_src=direction is Direction.LOAD)

    def _launch_kernel(self, direction: Direction, ranges: ByteRanges, stream: Any) -> Any:
        kernel = self._kernel
        if kernel is None:  # fell back since the caller looked: copy with DMA instead
            self._issue_memcpys(direction, ranges, stream)
            return None
        tiles = split_byte_ranges(ranges, KERNEL_TILE_BYTES)
        src, dst = self._endpoints(direction, tiles, self._host_dev_ptr)
        item = self._tables.take(tiles.num_ranges * 24)
        table = item[1][: 3 * tiles.num_ranges].reshape(-1, 3)
        table[:, 0] = src
        table[:, 1] = dst
        table[:, 2] = tiles.nbytes
        with stream:
            kernel((tiles.num_ranges,), (_KERNEL_THREADS,), (np.uint64(item[2]),))
        return item

    def _retire(self, seq: int) -> None:
        with self._lock:
            pending = self._pending.pop(seq, None)
        if pending is not None:
            for table in pending.tables:
                self._tables.give_back(table)

    def _retire_done(self) -> None:
        with self._lock:
            done = [seq for seq, p in self._pending.items() if p.event.done]
        for seq in done:
            self._retire(seq)
