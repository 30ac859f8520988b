"""The planner's records: what it remembers per request and per job in flight.

One record type per kind of job, its phase an enum, each field meaning one thing.
Scheduler thread only; never crosses the process boundary (``kv_offload.jobs`` does).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kv_offload.jobs import ChunkMove
from kv_offload.keys import ChunkKey
from kv_offload.scheduler.tiers import RequestLike


@dataclass(slots=True)
class RequestState:
    """What the planner keeps about one request between vLLM's calls."""

    request: RequestLike  # vLLM's Request
    next_store_chunk: int = 0  # chunks before it are stored or were skipped
    lookup: tuple[int, int] | None = None  # (num_computed_tokens, hit tokens) of the last ask
    remote: tuple[int, int, frozenset] | None = None  # (first chunk, num keys, hit keys) memo
    disk_outcome: tuple[int, int] = (0, 0)  # (hits, misses) of the last disk lookup
    tier_tokens: dict[str, int] = field(default_factory=dict)  # of the last planned load
    loading: bool = False  # a load was planned and the request has not run since
    same_step: bool = False  # the last lookup's hit loads in the step that schedules it
    load_from: int = 0  # tokens vLLM had computed locally when the last load was planned
    tail_planned: bool = False  # its prompt's tail was offered for storing (tails.py)
    # True: vLLM gave the last load up as a whole (freed its blocks, asked again), so
    # the request is answered a miss until it runs; None: no such load.
    load_given_up: bool | None = None


class LoadPhase(enum.Enum):
    LOADING = "loading"  # workers read and copy; waiting for every rank's report
    FILLING = "filling"  # applied; remote chunks still being written to the local disk


@dataclass(slots=True)
class LoadRecord:
    """A load job in flight: what it pins and what every rank reported."""

    keys: tuple[ChunkKey, ...]
    moves: tuple[ChunkMove, ...]
    staged: frozenset[int]  # chunk indexes read from disk or remote into a new CPU slot
    phase: LoadPhase = LoadPhase.LOADING
    failed_by_rank: dict[int, frozenset[int]] = field(default_factory=dict)
    bad_reads: set[int] = field(default_factory=set)  # staged reads that failed on a rank
    fill_sums_by_rank: dict[int, tuple[int | None, ...]] = field(default_factory=dict)
    fill_pinned: set[int] = field(default_factory=set)  # CPU slots kept pinned for fills

    @property
    def has_fills(self) -> bool:
        return any(m.fill_disk_slot is not None for m in self.moves)


class StorePhase(enum.Enum):
    COPYING = "copying"  # engine -> host copies; waiting for every rank
    WRITING = "writing"  # published in the CPU tier; disk and remote writes pending


@dataclass(slots=True)
class StoreRecord:
    """A store job in flight: its CPU slots, and what every rank reported."""

    keys: tuple[ChunkKey, ...]
    slots: tuple[int, ...]  # the CPU slot of each chunk
    moves: tuple[ChunkMove, ...]
    phase: StorePhase = StorePhase.COPYING
    ranks_copied: int = 0  # ranks whose engine -> host copy ended, well or not
    copy_failed: bool = False  # some rank's copy raised: the chunks are discarded
    tail: bool = False  # a request's tail (scheduler/tails.py): the CPU tier only
    disk_sums_by_rank: dict[int, tuple[int | None, ...]] = field(default_factory=dict)
    remote_ok_by_rank: dict[int, tuple[bool, ...]] = field(default_factory=dict)

    @property
    def has_disk(self) -> bool:
        return any(m.disk_slot is not None for m in self.moves)

    @property
    def has_remote(self) -> bool:
        return any(m.remote_key is not None for m in self.moves)
