"""DiskTier: the disk tier's scheduler half (``tier_contract.SecondaryTier``): the disk
index as the planner uses it, writes batched per step, turned off for good by a failure.

Commits and releases are queued and written with the step's allocation, or by ``flush``
at the end of the step: one LMDB write transaction per scheduler step instead of one per
call. Each write transaction costs ~20-60 us of LMDB work, and py-lmdb lets go of the
GIL twice in it, which costs the scheduler thread far more when vLLM's other threads are
busy (~0.5 ms a transaction inside an engine on 2 cores, docs/benchmarks.md).

A disk index that fails (``StoreError``: a full or read-only file system under the
index, a corrupted environment; or any other exception, logged with its traceback)
turns the disk tier off for the rest of the run, with one error line; serving goes on
from the CPU tier. It never escapes into vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from kv_offload.disk.errors import StoreError
from kv_offload.scheduler.events import ChunkBlocks, TierEvents, decode, encode
from kv_offload.scheduler.tails import tail_key
from kv_offload.tier_contract import Place

logger = logging.getLogger(__name__)
T = TypeVar("T")
NAME = "disk"
MAX_TAIL_NOTES = 4096
ACCESS_FLUSH_INTERVAL_S = 2.0
ACCESS_FLUSH_MAX_PENDING = 256
"""Disk hits written at the latest with this many pending: each moves an entry in the
index's LRU order (~5-25 us, more as the index grows), so a burst of hits is written in
steps of bounded cost instead of one long transaction every ACCESS_FLUSH_INTERVAL_S."""


class DiskEntryLike(Protocol):
    """A committed disk chunk (``kv_offload.disk.DiskEntry``)."""

    @property
    def key(self) -> bytes: ...

    @property
    def slot(self) -> int: ...

    @property
    def checksums(self) -> tuple[int, ...]: ...


class DiskIndexLike(Protocol):
    """The disk index (``kv_offload.disk.DiskIndex``; fakes in tests): which key lives in
    which slot. Any method may raise ``StoreError``."""

    def find_prefix(self, keys: Sequence[bytes]) -> Sequence[DiskEntryLike]: ...

    def count_lookup(self, *, hits: int, misses: int) -> None: ...

    def pin(self, slots: Sequence[int]) -> None: ...

    def unpin(self, slots: Sequence[int]) -> None: ...

    def settle(self, commits: Sequence[tuple[bytes, int, tuple[int, ...]]] = (),
               releases: Sequence[int] = (), keys: Sequence[bytes] = (),
               blocks: Mapping[bytes, bytes] | None = None,
               tails: Mapping[bytes, tuple[bytes, Sequence[int]]] | None = None
               ) -> tuple[list[bool], list[int | None]]: ...

    def tails_of(self, parent: bytes) -> list[tuple[bytes, tuple[int, ...]]]: ...

    # The KV events of the disk tier (``scheduler/events.py``): only used when they are on.
    track_removed: bool

    def take_removed(self) -> list[tuple[bytes, bytes | None]]: ...

    def read_blocks(self, after: bytes, limit: int) -> list[tuple[bytes, bytes | None]]: ...

    def drop(self, key: bytes, slot: int) -> bool: ...

    def flush_access(self) -> None: ...

    def num_pending_accesses(self) -> int: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


class DiskTier:
    """Wraps a disk index (or None: tier off). Scheduler thread only.

    While ``enabled``, lookups and allocations go to the index. Once a call raised
    (or ``disable`` was called) they answer "nothing" (no hit, no slot), while what
    jobs in flight hold is still unpinned, committed, released or dropped. Every call
    swallows the exception (the caller's fallback stands). Places: the slot, with each
    rank's checksum for reads.
    """

    name = NAME
    keeps_tails = True
    takes_fills = True  # remote chunks land on the local disk for the next restart

    def __init__(self, index: DiskIndexLike | None) -> None:
        self.index = index
        self.enabled = index is not None
        self._counters: Any = None
        self._clock: Callable[[], float] = time.monotonic
        self._last_access_flush = self._clock()
        self._commits: list[tuple[bytes, int, tuple[int, ...]]] = []
        self._releases: list[int] = []
        self._events: TierEvents | None = None  # attach_events
        self._read_after = b""  # the next batch of read_blocks (announcing)
        self._tails: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}  # note_tail

    def bind(self, counters: Any, clock: Callable[[], float]) -> None:
        self._counters, self._clock = counters, clock
        self._last_access_flush = clock()

    def forget(self, asker: str) -> None:
        pass  # answers are not memoised

    def expect_tails(self, asker: str, parents: Sequence[bytes]) -> None:
        pass  # tails_of answers at once (a read transaction)

    def note_tail(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        """``key`` is a request tail of ``parent``: its tail records are written with its
        commit (``tails_of`` finds it, also after a restart). Notes of tails that never
        commit age out past ``MAX_TAIL_NOTES``."""
        self._tails[key] = (parent, tokens)
        while len(self._tails) > MAX_TAIL_NOTES:
            del self._tails[next(iter(self._tails))]

    def tails_of(self, asker: str, parent: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, token ids) of the request tails of ``parent`` on disk ([] while off;
        never pending).
        A record whose token ids and parent do not make its key (``tails.tail_key``) is
        left out (invariant 9: damage, or another writer's records): a load would report
        tokens whose KV its slot does not hold."""
        index = self._active()
        if index is None:
            return []
        with self._guard("lookup"):
            return [(key, tokens) for key, tokens in index.tails_of(parent)
                    if tail_key(parent, tokens) == key]
        return []

    def find(self, asker: str, keys: Sequence[bytes]) -> list[Place]:
        """The committed leading chunks of ``keys`` (never pending)."""
        index = self._active()
        if index is None or not keys:
            return []
        with self._guard("lookup"):
            return [Place(NAME, e.slot, tuple(e.checksums)) for e in index.find_prefix(keys)]
        return []

    def count_lookup(self, hits: int, misses: int) -> None:
        index = self._active()
        if index is not None and (hits or misses):
            with self._guard("count_lookup"):
                index.count_lookup(hits=hits, misses=misses)

    def reserve(self, keys: Sequence[bytes]) -> list[Place | None]:
        """A slot (or None) per key; all None while the tier is off. Writes the queued
        commits and releases in the same transaction."""
        index = self._active()
        if index is not None and keys:
            commits, releases = self._take_queued()
            with self._guard("allocate"):
                slots = self._settle(index, commits, releases, keys)
                return [None if s is None else Place(NAME, s) for s in slots]
        return [None] * len(keys)

    def _active(self) -> DiskIndexLike | None:
        """The index while the tier is on (lookups and allocations), else None."""
        return self.index if self.enabled else None

    def pin(self, places: Sequence[Place]) -> None:
        self._call("pin", "pin", [int(p.address) for p in places])

    def unpin(self, places: Sequence[Place]) -> None:
        if places:
            self._call("unpin", "unpin", [int(p.address) for p in places])

    def release(self, places: Sequence[Place]) -> None:
        """Queue giving back reserved slots that will not be committed (``flush``)."""
        if self.index is not None:
            self._releases.extend(int(p.address) for p in places)

    def commit(self, items: Sequence[tuple[bytes, int, tuple[int, ...]]]) -> None:
        """Queue publishing written slots (``flush``); also after ``disable``: jobs in
        flight finish what they wrote."""
        if self.index is not None:
            self._commits.extend(items)

    def flush(self) -> None:
        """Write the queued commits and releases in one transaction (none if nothing is
        queued). The planner calls it at the end of every step."""
        if self.index is not None and (self._commits or self._releases):
            commits, releases = self._take_queued()
            with self._guard("commit"):
                self._settle(self.index, commits, releases)

    def _settle(self, index: DiskIndexLike, commits: list[tuple[bytes, int, tuple[int, ...]]],
                releases: list[int], keys: Sequence[bytes] = ()) -> list[int | None]:
        """``index.settle``; with KV events, each commit's blocks are kept with it and
        what became loadable (while the tier is on) or stopped is reported."""
        events = self._events
        tails = {c[0]: t for c in commits if (t := self._tails.pop(c[0], None)) is not None}
        if events is None:
            return index.settle(commits, releases, keys, tails=tails or None)[1]
        payloads, records = {}, {}
        for key, _, _ in commits:
            if (payload := events.payload(key)) is not None and (raw := encode(payload)):
                payloads[key], records[key] = payload, raw
        done, slots = index.settle(commits, releases, keys, blocks=records,
                                   tails=tails or None)
        if self.enabled:
            events.disk_stored((c[0], payloads.get(c[0])) for c, ok in zip(commits, done) if ok)
        self._report_removed()
        return slots

    def attach_events(self, events: TierEvents) -> None:
        """Report to ``events`` from now on, and announce what the index holds already
        (a restart: ``ANNOUNCE_BATCH`` chunks a step)."""
        if self.index is None:
            return
        self._events = events
        self.index.track_removed = True
        if self.enabled:
            events.announce_disk(self.read_blocks)

    def read_blocks(self, limit: int) -> list[tuple[bytes, ChunkBlocks | None]]:
        """The next ``limit`` committed chunks of the index with their blocks, in key
        order ([] at the end, or when the index fails)."""
        out: list[tuple[bytes, ChunkBlocks | None]] = []
        if self.index is not None:
            with self._guard("read_blocks"):
                out = [(k, decode(raw)) for k, raw in self.index.read_blocks(self._read_after, limit)]
        if out:
            self._read_after = out[-1][0]
        return out

    def _report_removed(self) -> None:
        if self._events is not None and self.index is not None:
            self._events.disk_removed((k, decode(raw)) for k, raw in self.index.take_removed())

    def has_queued(self) -> bool:
        """Whether commits or releases wait for ``flush``."""
        return bool(self._commits or self._releases)

    def _take_queued(self) -> tuple[list[tuple[bytes, int, tuple[int, ...]]], list[int]]:
        out = self._commits, self._releases
        self._commits, self._releases = [], []
        return out

    def written(self, keys: Sequence[bytes], places: Sequence[Place | None],
                results: Mapping[int, Sequence[object | None]],
                failed: frozenset[int] = frozenset()) -> int:
        """Commit the slots whose chunk every rank wrote (a checksum from each rank in
        ``results``, per chunk index), release the others and those in ``failed``;
        returns how many were committed."""
        ranks = sorted(results)
        commits: list[tuple[bytes, int, tuple[int, ...]]] = []
        releases: list[int] = []
        for i, (key, place) in enumerate(zip(keys, places)):
            if place is None:
                continue
            sums = tuple(results[r][i] for r in ranks)
            written = tuple(s for s in sums if isinstance(s, int))
            if i not in failed and len(written) == len(sums):
                commits.append((key, int(place.address), written))
            else:
                releases.append(int(place.address))
        self.commit(commits)
        if self.index is not None:
            self._releases.extend(releases)
        if self._counters is not None:
            self._counters.chunks_stored_disk += len(commits)
        return len(commits)

    def drop(self, place: Place, key: bytes) -> None:
        self._call("drop", "drop", key, int(place.address))
        self._report_removed()

    def end_step(self) -> None:
        """Write what no allocation wrote this step (one transaction), and the hits of
        the last ``ACCESS_FLUSH_INTERVAL_S`` or ``ACCESS_FLUSH_MAX_PENDING``."""
        self.flush()
        now = self._clock()
        if self.enabled and (now - self._last_access_flush >= ACCESS_FLUSH_INTERVAL_S
                             or self.num_pending_accesses() >= ACCESS_FLUSH_MAX_PENDING):
            self._last_access_flush = now
            self.flush_access()

    def flush_access(self, *, also_when_off: bool = False) -> None:
        if self.enabled or also_when_off:
            self._call("flush_access", "flush_access")

    def stats(self) -> dict | None:
        """The index's ``stats()``; None while the tier is off (or when it fails now)."""
        return self._ask("stats", None)

    def num_pending_accesses(self) -> int:
        """Hits not yet written to the index (0 while the tier is off)."""
        return self._ask("num_pending_accesses", 0)

    def close(self) -> None:
        self.flush()
        self._call("flush_access", "flush_access")
        self._call("close", "close")

    def disable(self, reason: str, *, failed: bool = True) -> None:
        """Stop using the disk tier for the rest of the run; logs once (``failed``:
        as an error naming the fix; otherwise the caller says why)."""
        if not self.enabled:
            return
        self.enabled = False
        if self._events is not None:  # every chunk it announced is withdrawn, in batches
            self._read_after = b""
            self._events.announce_disk(self.read_blocks, withdraw=True)
        if not failed:
            return
        logger.error(
            "kv-offload: the disk tier keeps failing (%s); it is disabled for this run and "
            "serving continues from the CPU tier. Fix the store directory (deleted, "
            "read-only, full or failing disk) and restart to use it again.", reason)

    def _call(self, what: str, method: str, *args: object) -> None:
        if self.index is not None:
            with self._guard(what):
                getattr(self.index, method)(*args)

    def _ask(self, method: str, default: T) -> T:
        """The index's ``method()`` while the tier is on, else (or when it fails) ``default``."""
        index = self._active()
        if index is not None:
            with self._guard(method):
                return getattr(index, method)()
        return default

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except StoreError as exc:
            self.disable(f"disk index {what}: {exc}")
        except Exception as exc:  # a bug, or an LMDB error not translated: same outcome
            logger.exception("kv-offload: disk index %s raised unexpectedly", what)
            self.disable(f"disk index {what}: {exc!r}")
