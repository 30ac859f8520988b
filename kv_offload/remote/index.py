"""RemoteIndex: the remote tier's scheduler half (``tier_contract.SecondaryTier``).

Which leading chunks of a request the shared server holds, asked without waiting on the
network: the tier's ``RemoteLookups`` asks the server on its own threads (started, and
connected, when the tier is bound at engine start), within the lookup budget, and the answer is memoised per request
(vLLM asks again, next step, while a request waits). A chunk's place is its key; there
is nothing to pin, reserve or commit: a chunk every rank wrote is there (until the
server evicts it: a read then misses and vLLM recomputes it). Whole chunks only (no
index of request tails). Counts lookups, their errors and time, and the chunks written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kv_offload.scheduler.events import Tier, TierEvents
from kv_offload.tier_contract import Place

NAME = "remote"


class RemoteIndex:
    """The scheduler's view of a ``remote.RemoteTier`` (see the module docstring).
    ``disable`` (the connector's reset, ``OffloadScheduler.reset_all``) stops lookups and
    stores for the rest of the run."""

    name = NAME
    keeps_tails = False
    takes_fills = False

    def __init__(self, remote: Any) -> None:
        self.remote = remote
        self.enabled = True
        self._counters: Any = None
        self._clock: Callable[[], float] = time.monotonic
        self._lookups: Any = None
        self._errors = 0
        self._memo: dict[str, tuple[tuple[bytes, ...], int]] = {}  # asker -> (keys, hits)
        self._events: TierEvents | None = None

    def bind(self, counters: Any, clock: Callable[[], float]) -> None:
        """Starts the lookup threads, which connect now (off this thread: a server that
        is down delays nothing, it only backs off), so that the first request's question
        pays no import or connection set-up within its budget."""
        self._counters, self._clock = counters, clock
        if self._lookups is None:
            self._lookups = self.remote.async_lookups(clock=clock)
            self._errors = self.remote.health.num_failures

    def find(self, asker: str, keys: Sequence[bytes]) -> list[Place] | None:
        """The leading chunks of ``keys`` the server holds; None while pending."""
        if not self.enabled or not keys:
            return []
        asked = tuple(keys)
        memo = self._memo.get(asker)
        if memo is not None and memo[0] == asked:
            return [Place(NAME, k) for k in asked[:memo[1]]]
        began = self._clock()
        hits = self._lookups.ask(asker, asked)
        self._counters.seconds_remote_lookup += self._clock() - began
        if hits is None:
            return None
        self._counters.remote_lookups += 1
        # Failed round trips and answers past the budget since the last answer.
        errors = self._lookups.num_timeouts + self.remote.health.num_failures
        self._counters.remote_lookup_errors += max(0, errors - self._errors)
        self._errors = errors
        self._memo[asker] = (asked, hits)
        return [Place(NAME, k) for k in asked[:hits]]

    def forget(self, asker: str) -> None:
        self._memo.pop(asker, None)
        if self._lookups is not None:
            self._lookups.forget(asker)

    def tails_of(self, parent: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
        return []

    def note_tail(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        pass  # never reserved: keeps_tails is False

    def count_lookup(self, hits: int, misses: int) -> None:
        pass  # counted per question (remote_lookups)

    def pin(self, places: Sequence[Place]) -> None:
        pass  # the server keeps or evicts on its own; a read that misses is recomputed

    def unpin(self, places: Sequence[Place]) -> None:
        pass

    def reserve(self, keys: Sequence[bytes]) -> list[Place | None]:
        """Every chunk is written under its key while the tier is on."""
        return [Place(NAME, k) if self.enabled else None for k in keys]

    def release(self, places: Sequence[Place]) -> None:
        pass

    def written(self, keys: Sequence[bytes], places: Sequence[Place | None],
                results: Mapping[int, Sequence[object | None]],
                failed: frozenset[int] = frozenset()) -> int:
        """Counts the chunks every rank wrote (and announces them as KV events)."""
        per_rank = list(results.values())
        done = [k for i, (k, p) in enumerate(zip(keys, places))
                if p is not None and i not in failed and all(r[i] for r in per_rank)]
        if self._counters is not None:
            self._counters.chunks_stored_remote += len(done)
        if self._events is not None and self.enabled:  # off after reset_all
            self._events.stored(Tier.REMOTE, done)
        return len(done)

    def drop(self, place: Place, key: bytes) -> None:
        pass  # another writer may have replaced it; the server's TTL and LRU age it out

    def end_step(self) -> None:
        pass

    def has_queued(self) -> bool:
        return False

    def disable(self, reason: str, *, failed: bool = True) -> None:
        """No lookups or stores for the rest of the run (jobs in flight finish)."""
        if not self.enabled:
            return
        self.enabled = False
        self._memo.clear()
        if self._events is not None:
            self._events.tier_off(Tier.REMOTE)

    def attach_events(self, events: TierEvents) -> None:
        self._events = events

    def stats(self) -> dict | None:
        """``up``: whether the server answers now (not backing off)."""
        return {"up": self.remote.health.up}

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
        self.remote.close()
