"""Torch copy engine: KV planes in host memory (the vLLM CPU backend) <-> host slots.

Synchronous: every copy has finished when ``store``/``load`` returns. The bytes move
through numpy views of the same memory (no copies of the planes), one call per
(plane, segment), where a segment is the blocks of one chunk that land on consecutive
host positions (usually the whole chunk):

- engine blocks consecutive (a fresh request): one slice copy (``np.copyto``);
- otherwise (a fragmented cache): one gather ``np.take(..., out=)`` for stores, one
  fancy-index scatter for loads; a single pass over the bytes either way.

Chosen by measurement (``benchmarks/bench_copy.py --strategies``; 16 layers x 16 KiB
pages, 32-64 MiB per call, shared 2-vCPU box, ratios vs the faster of torch.copy_ and
np.copyto of one buffer): this engine 0.7-1.0x for 2 and 8 MiB chunks (contiguous and
shuffled ids), 0.45-0.65x for 256 KiB chunks (16 KiB pieces, where ~1.2 us of Python per
piece shows). Per-(plane, chunk) ``index_select(out=)``/``index_copy_``: stores up to
~1x, but ``index_copy_`` loads 0.02-0.1x (uint8 rows go element-wise); per-plane gather
into a temp then scatter (``index_put_``): < 0.1x; per-run ``copy_`` slices: 0.1-0.6x
(per-block calls when ids are shuffled). torch ops also run on torch's OpenMP pool, which
contends with the model's threads; numpy copies are single-threaded and release the GIL,
so a background copy thread does not stall the model thread.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from kv_offload.copy.base import CopyEngine, CopyEngineClosedError, CopyHandle
from kv_offload.copy.plan import (
    Direction,
    SlotLayout,
    check_block_map,
    expand_chunks,
    plan_segments,
)
from kv_offload.copy.planes import describe_planes
from kv_offload.host_buffer import HostSlots

__all__ = ["TorchCopyEngine"]


class TorchCopyEngine(CopyEngine):
    """Copies chunks between CPU-resident planes and host slots, synchronously.

    Holds views of the planes and of ``host`` (both owned by the caller, who keeps them
    alive). Thread-safe: it keeps no mutable state besides a counter, so a store and a
    load (on disjoint slots and blocks) may run at once on different threads; copies
    release the GIL.
    """

    def __init__(self, planes: list[torch.Tensor], host: HostSlots, blocks_per_chunk: int) -> None:
        """Raises ValueError when the planes are not CPU planes (see ``describe_planes``)
        or a host slot cannot hold one chunk of them."""
        geometry = describe_planes(planes)
        if geometry.device.type != "cpu":
            raise ValueError(f"TorchCopyEngine needs planes in host memory, got {geometry.device}")
        if not isinstance(host, HostSlots):
            raise ValueError(f"host must be HostSlots, got {type(host).__name__}")
        self.layout = SlotLayout(geometry.plane_bytes, int(blocks_per_chunk), host.slot_bytes)
        self.num_blocks = geometry.num_blocks
        self.num_slots = host.num_slots
        self._planes = [p.numpy() for p in planes]
        bpc = self.layout.blocks_per_chunk
        self._host_planes = [
            host.tensor[:, off:off + bpc * pb].view(host.num_slots, bpc, pb).numpy()
            for off, pb in zip(self.layout.plane_offsets, self.layout.plane_bytes)
        ]
        self._seq = itertools.count()
        self._closed = False

    def store(self, block_ids: np.ndarray, slots: np.ndarray) -> CopyHandle:
        """Copy engine blocks into host slots now; the returned handle is done."""
        return self._copy(Direction.STORE, block_ids, slots)

    def load(self, slots: np.ndarray, block_ids: np.ndarray) -> CopyHandle:
        """Copy host slots into engine blocks now; the returned handle is done."""
        return self._copy(Direction.LOAD, block_ids, slots)

    def is_done(self, handle: CopyHandle) -> bool:
        return True

    def wait(self, handle: CopyHandle) -> None:
        return None

    def close(self) -> None:
        """Refuse further copies (nothing is in flight)."""
        self._closed = True

    def _copy(self, direction: Direction, block_ids: np.ndarray, slots: np.ndarray) -> CopyHandle:
        if self._closed:
            raise CopyEngineClosedError("TorchCopyEngine is closed")
        bm = expand_chunks(block_ids, slots, blocks_per_chunk=self.layout.blocks_per_chunk)
        check_block_map(bm, direction, num_engine_blocks=self.num_blocks,
                        num_slots=self.num_slots)
        seg = plan_segments(bm)
        store = direction is Direction.STORE
        columns = zip(seg.start.tolist(), seg.length.tolist(), seg.host_slot.tolist(),
                      seg.first_position.tolist(), seg.engine_start.tolist(),
                      seg.is_run.tolist())
        for start, length, slot, pos, first, is_run in columns:
            ids = None if is_run else bm.engine_blocks[start:start + length]
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
        return CopyHandle(next(self._seq), direction)
