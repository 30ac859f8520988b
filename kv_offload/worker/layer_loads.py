"""LayerWaits: a same-step load copied layer by layer, each attention layer waiting for its own.

vLLM's attention layers call ``wait_for_layer_load(layer_name)`` before they read their KV
(the ``maybe_transfer_kv_layer`` decorator) in eager and piecewise-graph forwards. On an
engine with streams a same-step load is issued in ``start_load_kv`` one layer at a time on
the load stream, an event recorded after each layer (``CopyEngine.load_by_layer``); each
layer's wait makes the compute stream wait for that layer's event only, so layer i+1's
copy overlaps layer i's compute and no host thread waits for a device copy. Each load's
last block, which the forward may write before any wait (a hit that ends inside it), is
copied first and the forward fenced after it (``last_blocks_apart``). Where the
layers will not call the hook (a FULL CUDA graph replays without Python; micro-batches;
no attention metadata) or the engine's layers are unknown, the forward is fenced after
the whole load instead. docs/architecture.md, "One same-step load".

Every method runs on vLLM's thread (the engine's device current).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from kv_offload.jobs import SKIP_BLOCK

if TYPE_CHECKING:
    from kv_offload.copy.base import CopyEngine, CopyHandle
    from kv_offload.copy.layers import PlaneLayers
    from kv_offload.worker.loads import WorkerLoad

__all__ = ["LayerWaits", "Unsettled", "attention_waits_per_layer", "audit_failed_rows",
           "last_blocks_apart"]

logger = logging.getLogger(__name__)


def attention_waits_per_layer(forward_context: Any) -> bool:
    """Whether every attention layer of the coming forward calls ``wait_for_layer_load``
    before it reads its KV, on the thread and stream that queue its kernels. Not under a
    FULL CUDA graph (V1 passes it as ``cudagraph_runtime_mode``: the replay runs no
    Python), nor without attention metadata (the decorator then skips the hook; V2 calls
    ``start_load_kv`` outside the forward's context before a FULL graph, so its context
    has none), nor with micro-batches (``ubatch_slices``: other threads and streams)."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return (getattr(forward_context, "attn_metadata", None) is not None
            and getattr(mode, "name", "NONE") != "FULL"
            and getattr(forward_context, "ubatch_slices", None) is None)


def last_blocks_apart(block_ids: np.ndarray, rows_per_load: Sequence[int]
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``block_ids`` (the rows of several loads, one load after the other) as two copies:
    ``(last, rest)``, ``last`` holding only each load's last block (the last one not
    ``SKIP_BLOCK`` in its last row), ``rest`` every other block; ``SKIP_BLOCK`` elsewhere.
    A load that ends inside a block (a hit to the last token but one, a request tail)
    shares that block with tokens the forward writes before any layer waits, so it must
    land before the forward. Pure; returns new arrays."""
    ids = np.asarray(block_ids, dtype=np.int64)
    last, rest = np.full_like(ids, SKIP_BLOCK), ids.copy()
    for end in np.cumsum(rows_per_load)[np.asarray(rows_per_load) > 0].tolist():
        cols = np.flatnonzero(ids[end - 1] != SKIP_BLOCK)
        if cols.size:
            last[end - 1, cols[-1]], rest[end - 1, cols[-1]] = ids[end - 1, cols[-1]], SKIP_BLOCK
    return last, rest


class LayerWaits:
    """The per-layer marks of this step's same-step loads, and the waits on them.

    ``engine``: returns the worker's current copy engine (it changes on a restore).
    ``layers``: the engine's planes per attention layer in forward order (None: unknown,
    every load is fenced whole). ``expect(forward_context)`` says per step whether the
    layers will wait; ``issue`` copies; ``wait`` orders one layer; ``end_forward`` closes
    the step (idempotent). Not thread-safe: vLLM's thread only."""

    def __init__(self, engine: Callable[[], CopyEngine], layers: PlaneLayers | None = None
                 ) -> None:
        self._engine = engine
        self.layers = layers
        self._per_layer = False  # this step's forward waits per layer (``expect``)
        self._broken = False  # a layer was not waited for once: whole fences from then on
        self._marks: list[tuple[object | None, ...]] = []  # per issue, per layer
        self._loads: list[tuple[WorkerLoad, Sequence[int]]] = []  # issued per layer
        self._waited: set[int] = set()
        self._failed_blocks: set[int] = set()
        self._discard = False
        self._told = False  # logged the first load copied per layer

    def expect(self, forward_context: Any) -> None:
        """Note whether this step's attention layers wait per layer
        (``attention_waits_per_layer``); ``start_load_kv``, before ``issue``."""
        self._per_layer = attention_waits_per_layer(forward_context)

    @property
    def per_layer(self) -> bool:
        """Whether ``issue`` copies layer by layer in this step."""
        return self._per_layer and self.layers is not None and not self._broken

    def issue(self, slots: np.ndarray, block_ids: np.ndarray,
              loads: Sequence[tuple[WorkerLoad, Sequence[int]]]) -> CopyHandle:
        """Issue the copy of ``slots`` into ``block_ids``, the rows of ``loads`` (this
        step's same-step loads, in that order), after the compute queued so far, and never
        wait on the host: fenced whole, so the forward queued next starts after all of it;
        or (``per_layer``) each load's last block fenced whole (``last_blocks_apart``), then
        the rest layer by layer over all loads (layer 0 of every load first). Returns the
        handle of the last copy issued (the load stream runs them in order). Raises what
        the engine raises (nothing was left in flight then)."""
        engine = self._engine()
        if not self.per_layer or self.layers is None:
            handle = engine.load(slots, block_ids)
            engine.fence(handle)
            return handle
        last, rest = last_blocks_apart(block_ids, [len(rows) for _, rows in loads])
        if (last != SKIP_BLOCK).any():
            engine.fence(engine.load(slots, last))
        copy = engine.load_by_layer(slots, rest, self.layers)
        if not self._told and any(m is not None for m in copy.layer_marks):
            self._told = True
            logger.info("kv-offload: same-step loads are copied layer by layer, each "
                        "attention layer waiting for its own (%s)", engine.copy_path)
        self._marks.append(copy.layer_marks)
        self._loads.extend(loads)
        return copy.handle

    def wait(self, layer_name: str) -> None:
        """Order the compute queued next on the calling thread's stream after the copies
        of ``layer_name`` (device-side). A layer these planes do not hold waits for every
        layer; a layer without copies waits for nothing."""
        if not self._marks or self.layers is None:
            return
        index = self.layers.index(layer_name)
        engine = self._engine()
        for marks in self._marks:
            for mark in marks if index is None else (marks[index],):
                engine.fence_mark(mark)
        self._waited.update(range(self.layers.num_layers) if index is None else (index,))

    def end_forward(self) -> None:
        """Close the step's per-layer loads once its forward is queued (``run_stores``,
        ``poll``; idempotent). A layer with copies that was never waited for may have
        been read before its copy: its copies are fenced now (later compute is ordered
        after them), the step's per-layer loads fail (their blocks: ``take_failed_blocks``;
        the stores: ``take_discard``) and later loads are fenced whole. Releases the marks."""
        if not self._marks:
            return
        engine = self._engine()
        missed = sorted({i for marks in self._marks for i, mark in enumerate(marks)
                         if mark is not None and i not in self._waited})
        for marks in self._marks:
            for mark in marks:
                if missed:
                    engine.fence_mark(mark)
                engine.release_mark(mark)
        if missed:
            self._broken = True
            self._discard = True
            names = [self.layers.names[i] for i in missed[:3]] if self.layers else []
            logger.error("kv-offload: attention layers %s... never waited for their same-step "
                         "load (wait_for_layer_load); the step's loads are recomputed and "
                         "later ones fence the whole forward", names)
            for load, rows in self._loads:
                load.failed.update(rows)
                load.reported_to_vllm = True  # here: every row failed, reported now
                # every failed chunk, those failed before the copy too (a vanished chunk):
                # vLLM keeps the blocks before the first one reported as computed
                self._failed_blocks.update(
                    b for i in load.failed for b in load.job.chunks[i].block_ids
                    if b != SKIP_BLOCK)
        self._marks, self._loads, self._waited = [], [], set()

    def take_failed_blocks(self) -> set[int]:
        """The engine blocks of per-layer loads failed by ``end_forward`` (once): this
        step's load errors. Closes the step first."""
        self.end_forward()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_discard(self) -> bool:
        """Whether the stores planned with this step must be discarded (its forward read a
        failed per-layer load), once. Closes the step first. A step without stores leaves
        the answer to the next plan's stores (at most once a run: loads are fenced whole
        after it)."""
        self.end_forward()
        discard, self._discard = self._discard, False
        return discard


def audit_failed_rows(loads: Sequence[tuple[WorkerLoad, Sequence[int]]], slots: np.ndarray,
                      block_ids: np.ndarray, check: Callable[[np.ndarray, np.ndarray], set[int]],
                      *, last: bool) -> None:
    """Audit a same-step copy per layer: ``check(block_ids, slots)``
    (``CopyAudit.check_load``) over each load's last block (``last``: right after
    ``LayerWaits.issue`` copied them, before the forward writes the hit's next tokens
    into them) or over every other block (after the forward: ``last_blocks_apart``); a
    row it finds wrong fails its chunk (``load.failed``: a load error of this step)."""
    parts = last_blocks_apart(block_ids, [len(rows) for _, rows in loads])
    bad = check(parts[0] if last else parts[1], slots)
    row = 0
    for load, rows in loads:
        load.failed.update(r for i, r in enumerate(rows) if row + i in bad)
        row += len(rows)


class Unsettled:
    """Same-step copies per layer on an engine without streams (the CPU backend), which
    end with the forward: each layer waited for its own, or ``LayerWaits.end_forward``
    fenced them. vLLM's thread settles them (``settle``) before the step's stores and its
    ``poll``: this step must report their failures, the only step in which vLLM takes
    load errors of a running request, and a failed one spoils the step's stores (the
    forward read it). vLLM's thread only."""

    def __init__(self) -> None:
        self._queue: collections.deque[
            tuple[Callable[[], None], Future[None], list[WorkerLoad]]] = collections.deque()
        self._spoiled = False

    def add(self, settle: Callable[[], None], loads: list[WorkerLoad]) -> Future[None]:
        """Queue ``settle`` (which never raises: it fails the loads' chunks) for
        ``loads``; returns the future that ends with it."""
        future: Future[None] = Future()
        self._queue.append((settle, future, loads))
        return future

    def settle(self) -> None:
        """Run every queued settle, in order, and end their futures."""
        while self._queue:
            settle, future, loads = self._queue.popleft()
            settle()
            future.set_result(None)
            self._spoiled |= any(load.failed for load in loads)

    def take_spoiled(self) -> bool:
        """Whether a load settled since the last call failed (once): the stores planned
        with its step must be discarded."""
        self.settle()
        spoiled, self._spoiled = self._spoiled, False
        return spoiled
