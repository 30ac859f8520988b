"""BlockHolds: which requests' engine blocks must outlive the request (invariant 3).

A store job copies engine blocks to host slots after the forward that wrote them, in
the background: the step never waits for it. Blocks of a running request are never
rewritten, so only blocks that vLLM frees can be overwritten under a copy: those of a
request that finishes (or is aborted) while a copy of its blocks is in flight. Such a
request is *held*: ``KVOffloadConnector.request_finished`` tells vLLM to keep its blocks
until every rank reports it in ``finished_sending``, which a worker does once its own
copies of that request's blocks are done. Preempted requests are fenced by the workers
instead (their blocks are freed at once, before this step's forward), and so are running
requests whose sliding-window blocks under a copy vLLM freed (it frees blocks that left
the window while the request runs), and running requests whose mamba state blocks under
a copy vLLM freed (it frees a state block once the next state was copied from it):
``window_sources`` names those blocks by (group, table index, block id), so that a block
freed and given back to the same request at another position counts as freed.

Scheduler thread only. Pure bookkeeping: no I/O, no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

BlockTables = Sequence[Sequence[int]] | Sequence[int]
"""A request's engine blocks: one table per KV cache group, or one flat table."""
WindowSource = tuple[int, int, int]
"""A sliding-window or mamba state block a copy reads: (group, index in the request's
table, block id)."""


class BlockHolds:
    """Store jobs whose engine -> host copy is not yet reported done by every rank, per
    request; and the finished requests held for them."""

    def __init__(self) -> None:
        self._jobs_of: dict[str, set[int]] = {}  # request -> copying store jobs
        self._reqs_of: dict[int, set[str]] = {}  # copying store job -> requests
        self._held: set[str] = set()  # finished, blocks kept until finished_sending
        self._new_held: list[str] = []  # held since the last plan
        self._window: dict[int, dict[str, frozenset[WindowSource]]] = {}  # job -> req -> ...

    def copying(self, job_id: int, req_ids: Iterable[str],
                window_sources: Mapping[str, Iterable[WindowSource]] | None = None) -> None:
        """A store job of the blocks of ``req_ids`` was planned (its copy starts now);
        ``window_sources``: per request, the sliding-window blocks it copies."""
        reqs = set(req_ids)
        if not reqs:
            return
        self._reqs_of[job_id] = reqs
        for req in reqs:
            self._jobs_of.setdefault(req, set()).add(job_id)
        window = {r: frozenset(b) for r, b in (window_sources or {}).items() if b and r in reqs}
        if window:
            self._window[job_id] = window

    def window_sources(self) -> dict[str, set[WindowSource]]:
        """Per request, the sliding-window blocks that copies in flight read."""
        out: dict[str, set[WindowSource]] = {}
        for per_req in self._window.values():
            for req, blocks in per_req.items():
                out.setdefault(req, set()).update(blocks)
        return out

    def copied(self, job_id: int) -> None:
        """Every rank finished the job's engine -> host copy. Unknown ids are ignored."""
        self._window.pop(job_id, None)
        for req in self._reqs_of.pop(job_id, ()):
            jobs = self._jobs_of.get(req)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._jobs_of[req]

    def finish(self, req_id: str) -> bool:
        """``req_id`` finished: True when its blocks must be held (a copy of them may
        still be running on some rank), and then it goes out with the next plan."""
        if req_id not in self._jobs_of or req_id in self._held:
            return False
        self._held.add(req_id)
        self._new_held.append(req_id)
        return True

    def take_new(self) -> tuple[str, ...]:
        """The requests held since the last call (each handed to the workers once)."""
        out, self._new_held = tuple(self._new_held), []
        return out

    def forget(self, req_ids: Iterable[str]) -> None:
        """These preempted requests' copies were fenced (vLLM freed their blocks, and
        the workers order the next forward after the copies): nothing of them is held
        any more. A request run again is tracked afresh by its new store jobs."""
        for req in req_ids:
            for job_id in self._jobs_of.pop(req, ()):
                reqs = self._reqs_of.get(job_id)
                if reqs is not None:
                    reqs.discard(req)
                self._drop_window(job_id, req)

    def released(self, req_ids: Iterable[str]) -> None:
        """vLLM freed these requests' blocks (every rank reported them sent)."""
        for req in req_ids:
            self._held.discard(req)
            for job_id in self._jobs_of.pop(req, ()):
                self._drop_window(job_id, req)

    def _drop_window(self, job_id: int, req: str) -> None:
        per_req = self._window.get(job_id)
        if per_req is not None:
            per_req.pop(req, None)
            if not per_req:
                del self._window[job_id]

    def num_held(self) -> int:
        return len(self._held)

    def is_copying(self, req_id: str) -> bool:
        return req_id in self._jobs_of


def block_tables(block_ids: BlockTables) -> Sequence[Sequence[int]]:
    """One table per KV cache group, also from a flat table (one group)."""
    if len(block_ids) and not isinstance(block_ids[0], (list, tuple)):
        return (block_ids,)  # type: ignore[return-value]
    if not len(block_ids):
        return ((),)
    return block_ids  # type: ignore[return-value]


def sources_freed(sources: Iterable[WindowSource], tables: Sequence[Sequence[int]]) -> bool:
    """Whether a block of ``sources`` (copies in flight) is no longer at its place in a
    request's ``tables``: vLLM freed it."""
    return any(g >= len(tables) or index >= len(tables[g]) or int(tables[g][index]) != block
               for g, index, block in sources)


def window_sources_of(job: Any, positions: Sequence[tuple[int, int]],
                      block_ids_of: Callable[[str], Any]) -> dict[str, set[WindowSource]]:
    """Per request, the sliding-window and mamba state blocks store ``job`` copies, by
    (group, table index, block id) in the request's tables now (``block_ids_of``);
    ``positions``: ``ChunkMap.released_positions`` (empty without such groups)."""
    out: dict[str, set[WindowSource]] = {}
    if not positions:
        return out
    index_of: dict[str, list[dict[int, int]]] = {}  # per request and group: block -> index
    for move, req in zip(job.chunks, job.req_ids):
        if req not in index_of:  # a block is once in a table: vLLM's own
            index_of[req] = [{int(b): i for i, b in enumerate(table)}
                             for table in block_tables(block_ids_of(req))]
        for position, group in positions:
            block = move.block_ids[position]
            out.setdefault(req, set()).add((group, index_of[req][group][block], block))
    return out
