"""The tier contract: what the planner and the workers need of a tier below the CPU tier.

The CPU tier (host RAM: ``scheduler.cpu_index`` and the host slots) is the primary tier:
every chunk a load takes passes through one of its slots, and every store lands there
first. Below it, an ordered list of *secondary tiers* (the disk, then the remote tier;
a test adds an in-memory one, ``tests/tiers/test_memory_tier.py``) keeps copies of host
slots. Each is one package owning two halves:

- ``SecondaryTier``, on the scheduler: which leading chunks of a list it holds, and which
  request tails of a parent (at once, or "ask again" while its answer is pending), addresses to write new chunks to, pins,
  committing what every rank wrote, dropping a chunk a read found bad, turning itself
  off.
- ``TierIO``, on each worker rank: read an address into a host slot, write host slots to
  addresses, report that it keeps failing.

A ``Place`` names a chunk in one tier; ``jobs.ChunkMove`` carries where a load reads
from (``source``) and where a store, or a load's fill, writes to (``sinks``). Workers
report each sink's results per job, tier and rank (``jobs.WorkerReport.written``).

Plain values and protocols only: this module imports nothing of kv-offload's packages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Address = int | bytes
"""Where a chunk lives in a tier: a slot number (disk) or a key (remote)."""


@dataclass(frozen=True, slots=True)
class Place:
    """A chunk's address in the tier named ``tier``; ``checksums``: per rank, what a
    read must find (None: the tier verifies on its own, or not at all)."""

    tier: str
    address: Address
    checksums: tuple[int, ...] | None = None


class SecondaryTier(Protocol):
    """The scheduler half of a tier below the CPU tier. Scheduler thread only.

    No method raises into the planner: a tier that fails turns itself off (``enabled``
    False) and answers "nothing" from then on, while what jobs in flight hold is still
    unpinned, committed or released. Addresses are what ``reserve`` and ``find`` gave.
    """

    name: str  # the tier's name in places, reports and counters ("disk", "remote", ...)
    enabled: bool  # False: off for the rest of the run (failed, or reset)
    keeps_tails: bool  # stores request tails (scheduler/tails.py) and finds them again
    takes_fills: bool  # a load from a later tier also writes its chunks here

    def bind(self, counters: Any, clock: Callable[[], float]) -> None:
        """The scheduler's counters (``counters.SchedulerCounters``) and clock, once."""

    def find(self, asker: str, keys: Sequence[bytes]) -> Sequence[Place] | None:
        """The places of the leading chunks of ``keys`` this tier holds now, in order;
        None while the answer is pending (the planner asks again next step, with the same
        ``asker``: the request id; a request's tail is asked for as ``lookup.tail_asker``,
        by tiers that keep tails, which answer it at once once ``tails_of`` reported it).
        Never waits on I/O it cannot bound."""

    def forget(self, asker: str) -> None:
        """``asker`` will not ask again (its request finished)."""

    def tails_of(self, asker: str, parent: bytes
                 ) -> Sequence[tuple[bytes, tuple[int, ...]]] | None:
        """(key, token ids) of the request tails of ``parent`` it holds ([] if none),
        oldest first; None while the answer is pending, as for ``find`` (the planner asks
        again next step with the same ``asker``, ``lookup.tail_asker``, forgotten with
        ``forget``). A tier that answers None bounds the wait (the remote tier: its lookup
        budget, then []). Only tails whose key ``tails.tail_key(parent, tokens)`` makes:
        never tokens whose KV it does not hold."""

    def expect_tails(self, asker: str, parents: Sequence[bytes]) -> None:
        """The planner may soon ask ``tails_of(asker, parent)`` for these parents (asked
        while ``asker``'s chunk question is pending, ``lookup.expect_tails``): a tier whose
        answer takes a round trip starts asking now, so that the later ``tails_of``
        answers at once; one that answers at once does nothing. Never waits on I/O; a
        hint: ``tails_of`` answers the same either way."""

    def note_tail(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        """``key``, about to be reserved, is a request tail of ``parent``."""

    def count_lookup(self, hits: int, misses: int) -> None:
        """A scheduled request found ``hits`` chunks here and ``misses`` nowhere."""

    def pin(self, places: Sequence[Place]) -> None:
        """Keep these chunks (a load reads them) until ``unpin``."""

    def unpin(self, places: Sequence[Place]) -> None: ...

    def reserve(self, keys: Sequence[bytes]) -> list[Place | None]:
        """A place to write each of ``keys`` to (None: not stored here); invisible to
        ``find`` until ``written`` commits it."""

    def release(self, places: Sequence[Place]) -> None:
        """Give back reserved places that will not be written."""

    def written(self, keys: Sequence[bytes], places: Sequence[Place | None],
                results: Mapping[int, Sequence[object | None]],
                failed: frozenset[int] = frozenset()) -> int:
        """Every rank's results of writing ``places`` (rank -> per chunk: what the
        rank's ``TierIO.write`` returned, None where it failed): commit those that every
        rank wrote and that are not in ``failed``, give the rest back. Returns how many
        were committed."""

    def drop(self, place: Place, key: bytes) -> None:
        """A read of ``place`` found no intact chunk: forget it."""

    def end_step(self) -> None:
        """The end of a scheduler step: write what was batched."""

    def disable(self, reason: str, *, failed: bool = True) -> None:
        """Off for the rest of the run (``failed``: logged as an error naming the fix)."""

    def has_queued(self) -> bool:
        """Whether work waits for ``end_step``."""

    def attach_events(self, events: Any) -> None:
        """Report KV events (``scheduler.events.TierEvents``) from now on."""

    def stats(self) -> dict | None: ...

    def close(self) -> None: ...


class TierIO(Protocol):
    """The worker half of a secondary tier, for one rank. Called on the worker's I/O
    threads (reads on the read lane, writes on the write lane); never raises: a failure
    is a miss or an unwritten chunk, counted."""

    name: str
    write_batch: int  # chunks per write task (a task is one call of ``write``)

    def bind(self, count: Callable[[Any], None], clock: Callable[[], float]) -> None:
        """Where to add worker counter deltas (``counters.WorkerCounters``), once."""

    def read(self, place: Place, out: memoryview) -> bool:
        """Read the chunk at ``place`` into ``out``; whether it now holds it, verified."""

    def write(self, addresses: Sequence[Address], views: Sequence[memoryview]
              ) -> list[object | None]:
        """Write each view to its address; per chunk a result for the scheduler half's
        ``written`` (a checksum, True), None when it was not written."""

    def take_broken(self) -> str | None:
        """Why the tier keeps failing on this rank, once (the scheduler turns it off)."""

    def close(self) -> None: ...
