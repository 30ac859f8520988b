"""CopyAudit: the runtime audit, a sample of copies checked again against the engine.

Silent corruption (a stream race in a store or load, a layout that changed) costs wrong
tokens, not errors. For a fraction ``rate`` of the chunks a worker copies:

- a store: once its copy has ended, the chunk's engine blocks are copied again, into a
  scratch slot, and compared with the host slot. The blocks are still protected: the
  check is part of the store's ``HostCopy`` (``check_store``), so a finished request
  stays held (invariant 3) and the job is not reported until the check ends; a
  preempted request's ``fence`` stops the check (its blocks go to the next forward)
  after waiting for a re-read in flight. A mismatch fails the job: its chunks are never
  published, nor written to the disk or remote tier.
- a load: once it has ended, the engine blocks it wrote are copied back and compared
  with the host slot it read (``check_load``); a mismatch is a load error (vLLM
  recomputes). The blocks belong to a request vLLM does not schedule before the load is
  reported.

A mismatch is logged as an error, counted (``audit_mismatches``), and the engine falls
back to its plainest copy path (``CopyEngine.fall_back_to_plainest``). The re-reads go
through a second engine over the same planes (``reader``, on its plainest path, ordered
after no compute: ``unordered_mark``) into ``scratch`` slots of their own. Store checks
run on one audit thread; load checks on the thread that ran the load.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from kv_offload.copy.base import CopyEngine, CopyHandle
from kv_offload.copy.host_buffer import HostSlots
from kv_offload.copy.plan import SKIP_BLOCK, SlotLayout
from kv_offload.counters import WorkerCounters, WorkerTally

if TYPE_CHECKING:
    import torch

__all__ = ["AUDIT_SCRATCH_SLOTS", "AuditMismatchError", "CopyAudit", "StoreCheck",
           "build_audit"]

logger = logging.getLogger(__name__)

AUDIT_SCRATCH_SLOTS = 2
"""Scratch slots for re-reads: one store check and one load check at a time."""
_COMPARE_PIECE = 4 << 20  # compare in pieces: no temporary the size of a chunk


class AuditMismatchError(RuntimeError):
    """A copied chunk differs from the engine blocks it was copied from or to."""


class StoreCheck:
    """The audit of one store copy: ends once its sampled chunks were re-read and
    compared (``done``); ``failed`` when one differed. Shaped as ``HostCopies`` checks
    are (``done``, ``failed``, ``wait``, ``fence``; see ``worker/host_copies.py``)."""

    def __init__(self, audit: CopyAudit, wait_copy: Callable[[], None], block_ids: np.ndarray,
                 slots: np.ndarray, rows: list[int]) -> None:
        self._audit, self._wait_copy = audit, wait_copy
        self._block_ids, self._slots, self._rows = block_ids, slots, rows
        self._lock = threading.Lock()
        self._stopped = False  # fenced: the blocks may be rewritten, re-read nothing more
        self._reading: CopyHandle | None = None
        self._ended = threading.Event()
        self._mismatch: str | None = None

    def done(self) -> bool:
        return self._ended.is_set()

    def failed(self) -> bool:
        return self._ended.is_set() and self._mismatch is not None

    def wait(self) -> None:
        """Block until the check ended; AuditMismatchError when a chunk differed."""
        self._ended.wait()
        if self._mismatch is not None:
            raise AuditMismatchError(self._mismatch)

    def fence(self) -> None:
        """The blocks go to the next forward (a preempted request): re-read nothing
        more, and wait (on the host: one chunk's copy) for a re-read in flight."""
        with self._lock:
            self._stopped = True
            reading = self._reading
        if reading is not None:
            self._audit.reader.wait(reading)

    def run(self) -> None:
        """Wait for the store copy, then re-read and compare each sampled chunk (the
        audit thread). A copy that failed is the copy's failure, not the check's."""
        try:
            try:
                self._wait_copy()
            except Exception:
                return
            for row in self._rows:
                ok = self._audit.reread(self._block_ids[row:row + 1], int(self._slots[row]),
                                        guard=self)
                if ok is None:
                    return  # fenced
                if not ok:
                    self._mismatch = self._audit.mismatch(
                        "store", int(self._slots[row]), self._block_ids[row])
                    return
        except Exception:  # a bug or a broken device: the audit cannot tell, say so
            logger.exception("kv-offload: the audit of a store copy failed to run")
        finally:
            self._ended.set()

    def begin_read(self, issue: Callable[[], CopyHandle]) -> CopyHandle | None:
        """Issue a re-read unless fenced (None then); its handle is kept for ``fence``."""
        with self._lock:
            if self._stopped:
                return None
            self._reading = issue()
            return self._reading

    def end_read(self) -> None:
        with self._lock:
            self._reading = None


class CopyAudit:
    """Samples chunks at ``rate`` and checks their copies (see the module docstring).

    ``engine``: the worker's copy engine (falls back on a mismatch); ``reader``: a second
    engine over the same planes, whose host slots are ``scratch`` (at least
    ``AUDIT_SCRATCH_SLOTS`` slots laid out like ``host``, per ``layout``). The audit owns
    ``reader`` (``close`` closes it, after the audit thread), not ``engine``. Thread-safe.
    """

    def __init__(self, *, engine: CopyEngine, reader: CopyEngine, host: HostSlots,
                 scratch: HostSlots, layout: SlotLayout, rate: float,
                 rng: random.Random | None = None) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"audit rate must be in (0, 1], got {rate}")
        if scratch.num_slots < AUDIT_SCRATCH_SLOTS or scratch.slot_bytes < layout.chunk_bytes:
            raise ValueError("the audit needs scratch slots that hold a chunk")
        self.engine, self.reader, self.rate = engine, reader, rate
        self._host, self._scratch, self._layout = host, scratch, layout
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(AUDIT_SCRATCH_SLOTS):
            self._free.put(slot)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-audit")
        self._tally = WorkerTally()

    # -- what the worker calls ---------------------------------------------------------

    def check_store(self, wait_copy: Callable[[], None], block_ids: np.ndarray,
                    slots: np.ndarray) -> StoreCheck | None:
        """A check of a store copy just issued (``wait_copy`` waits for it and raises if
        it failed), or None when no chunk of it was sampled. Starts at once, on the
        audit thread."""
        rows = self._sample(slots.shape[0])
        if not rows:
            return None
        check = StoreCheck(self, wait_copy, np.asarray(block_ids), np.asarray(slots), rows)
        try:
            self._thread.submit(check.run)
        except RuntimeError:  # closed
            return None
        return check

    def check_load(self, block_ids: np.ndarray, slots: np.ndarray) -> set[int]:
        """After a load ended: the sampled rows whose engine blocks differ from the host
        slot they were loaded from (calling thread; blocks for the re-reads)."""
        bad: set[int] = set()
        for row in self._sample(slots.shape[0]):
            ok = self.reread(np.asarray(block_ids[row:row + 1]), int(slots[row]), guard=None)
            if ok is False:
                self.mismatch("load", int(slots[row]), block_ids[row])
                bad.add(row)
        return bad

    def take_counts(self) -> WorkerCounters:
        """Counter deltas since the last call (``audit_chunks``, ``audit_mismatches``)."""
        return self._tally.take()

    def close(self) -> None:
        """Let checks already started end, then close ``reader``; no new checks."""
        self._thread.shutdown(wait=True)
        self.reader.close()

    # -- the checks --------------------------------------------------------------------

    def reread(self, row: np.ndarray, slot: int, *, guard: StoreCheck | None) -> bool | None:
        """Re-read the engine blocks of one chunk ``row`` (1 x blocks_per_chunk) into a
        scratch slot and compare them with host slot ``slot``; None when ``guard`` was
        fenced before the read was issued."""
        scratch = self._free.get()
        try:
            def issue() -> CopyHandle:
                return self.reader.store(row, np.array([scratch]),
                                         after=self.reader.unordered_mark())

            handle = issue() if guard is None else guard.begin_read(issue)
            if handle is None:
                return None
            try:
                self.reader.wait(handle)
            finally:
                if guard is not None:
                    guard.end_read()
            self._tally.add(WorkerCounters(audit_chunks=1))
            return self._same(slot, scratch, row[0])
        finally:
            self._free.put(scratch)

    def mismatch(self, what: str, slot: int, blocks: np.ndarray) -> str:
        """Log, count and act on a mismatch: the engine falls back to its plainest path."""
        path = self.engine.copy_path
        fell_back = self.engine.fall_back_to_plainest()
        message = (f"{what} copy of host slot {slot} (engine blocks "
                   f"{[int(b) for b in blocks]}) differs from the engine blocks (copy path "
                   f"{path})")
        logger.error("kv-offload AUDIT MISMATCH: the %s; the chunk is discarded%s", message,
                     f" and copies now use {fell_back}" if fell_back else "")
        self._tally.add(WorkerCounters(audit_mismatches=1))
        return message

    def _same(self, slot: int, scratch: int, row: np.ndarray) -> bool:
        """Whether the copied positions of host slot ``slot`` equal scratch slot
        ``scratch`` (positions skipped in ``row`` hold whatever they held)."""
        host = np.frombuffer(self._host.slot_view(slot), np.uint8)
        read = np.frombuffer(self._scratch.slot_view(scratch), np.uint8)
        lay = self._layout
        keep = np.asarray(row) != SKIP_BLOCK
        if keep.all():
            return _equal(host[:lay.chunk_bytes], read[:lay.chunk_bytes])
        for offset, size in zip(lay.plane_offsets, lay.plane_bytes):
            end = offset + lay.blocks_per_chunk * size
            a = host[offset:end].reshape(lay.blocks_per_chunk, size)[keep]
            b = read[offset:end].reshape(lay.blocks_per_chunk, size)[keep]
            if not np.array_equal(a, b):
                return False
        return True

    def _sample(self, num_chunks: int) -> list[int]:
        with self._rng_lock:
            return [i for i in range(num_chunks) if self._rng.random() < self.rate]



def build_audit(planes: list[torch.Tensor], host: HostSlots, blocks_per_chunk: int, *,
                engine: CopyEngine, rate: float) -> CopyAudit | None:
    """The audit of ``engine``'s copies at ``rate`` (None when 0): a reader engine over
    the same planes on its plainest path, and scratch slots like ``host`` (pinned with
    it). The caller keeps ``planes`` and ``host`` alive and closes the audit."""
    if rate <= 0:
        return None
    from kv_offload.copy import make_copy_engine
    from kv_offload.copy.host_buffer import allocate_host_slots
    from kv_offload.copy.planes import describe_planes

    layout = SlotLayout(describe_planes(planes).plane_bytes, blocks_per_chunk, host.slot_bytes)
    scratch = allocate_host_slots(AUDIT_SCRATCH_SLOTS, host.slot_bytes, pinned=host.pinned)
    reader = make_copy_engine(planes, scratch, blocks_per_chunk, copy_mode="dma")
    reader.fall_back_to_plainest()
    return CopyAudit(engine=engine, reader=reader, host=host, scratch=scratch, layout=layout,
                     rate=rate)


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality, piece by piece (numpy makes a bool temporary per piece)."""
    for start in range(0, a.shape[0], _COMPARE_PIECE):
        if not np.array_equal(a[start:start + _COMPARE_PIECE], b[start:start + _COMPARE_PIECE]):
            return False
    return True
