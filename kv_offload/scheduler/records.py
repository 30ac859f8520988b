"""The planner's records: what it remembers per request and per job in flight.

One record type per kind of job, its phase an enum, each field meaning one thing.
Scheduler thread only; never crosses the process boundary (``kv_offload.jobs`` does).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kv_offload.jobs import ChunkMove, Results
from kv_offload.keys import ChunkKey


class RequestLike(Protocol):
    """A vLLM request as the planner reads it (read-only: the planner never sets these)."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


Written = dict[str, Results]
"""Tier -> rank -> per chunk of a job, the rank's write result (``WorkerReport.written``)."""


@dataclass(slots=True)
class RequestState:
    """What the planner keeps about one request between vLLM's calls."""

    request: RequestLike  # vLLM's Request
    next_store_chunk: int = 0  # chunks before it are stored or were skipped
    lookup: tuple[int, int] | None = None  # (num_computed_tokens, hit tokens) of the last ask
    tier_outcome: dict[str, tuple[int, int]] = field(default_factory=dict)  # tier -> (hits,
    # misses) of the last lookup
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
    FILLING = "filling"  # applied; chunks still being written to earlier tiers (fills)


@dataclass(slots=True)
class LoadRecord:
    """A load job in flight: what it pins and what every rank reported."""

    keys: tuple[ChunkKey, ...]
    moves: tuple[ChunkMove, ...]
    staged: frozenset[int]  # chunk indexes read from a secondary tier into a new CPU slot
    phase: LoadPhase = LoadPhase.LOADING
    failed_by_rank: dict[int, frozenset[int]] = field(default_factory=dict)
    bad_reads: set[int] = field(default_factory=set)  # staged reads that failed on a rank
    fills: Written = field(default_factory=dict)  # what the ranks wrote to the sinks
    fill_pinned: set[int] = field(default_factory=set)  # CPU slots kept pinned for fills

    @property
    def sink_tiers(self) -> set[str]:
        return sink_tiers(self.moves)


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
    tail: bool = False  # a request's tail (scheduler/tails.py): tiers that keep tails only
    written: Written = field(default_factory=dict)  # what the ranks wrote to the sinks

    @property
    def sink_tiers(self) -> set[str]:
        return sink_tiers(self.moves)


def sink_tiers(moves: tuple[ChunkMove, ...]) -> set[str]:
    """The tiers some move of a job writes to."""
    return {place.tier for move in moves for place in move.sinks}


def all_written(written: Written, tiers: set[str], num_ranks: int) -> bool:
    """Whether every rank reported its writes to each of ``tiers``."""
    return all(len(written.get(tier, ())) >= num_ranks for tier in tiers)


def add_written(written: Written, by_tier: dict[str, Results]) -> None:
    """Fold one report's ``WorkerReport.written`` entry of a job into ``written``."""
    for tier, by_rank in by_tier.items():
        written.setdefault(tier, {}).update(by_rank)


def sink_places(moves: tuple[ChunkMove, ...], tier: str) -> list:
    """Per move, its sink in ``tier`` (None where it has none)."""
    return [next((p for p in m.sinks if p.tier == tier), None) for m in moves]
