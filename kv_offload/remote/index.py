"""RemoteIndex: the remote tier's scheduler half (``tier_contract.SecondaryTier``).

Which leading chunks of a request the shared server holds, asked without waiting on the
network: the tier's ``RemoteLookups`` asks the server on its own threads (started, and
connected, when the tier is bound at engine start), within the lookup budget, and the answer is memoised per request
(vLLM asks again, next step, while a request waits). A chunk's place is its key; there
is nothing to pin, reserve or commit: a chunk every rank wrote is there (until the
server evicts it: a read then misses and vLLM recomputes it). Counts lookups, their
errors and time, and the chunks written.

Request tails (``scheduler/tails.py``): a tail is reserved and written like a chunk;
once every rank wrote it, its record (parent, token ids) is queued for the tier's
``TailWriter`` (``remote/tail_records.py``). ``tails_of`` asks a second
``RemoteLookups`` (started at bind too; same budget and rules; its fetch reads the
parents' records and checks every rank's value exists, ``RemoteTails.tails_many``). One
question may name several parents (one round trip): ``expect_tails``, which the planner
calls while the request's chunk question is pending, asks for the parents its run would
end at on a complete miss or a full hit, so that ``tails_of`` of either answers in the
same step as the chunks (a miss waits one step, not two). Answers are memoised per
(asker, parent), at most ``MAX_TAIL_PARENTS`` per asker, forgotten with ``forget``;
``find`` of a tail it reported answers at once from that memo.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kv_offload.remote.tail_records import RemoteTails, Tail, TailWriter
from kv_offload.scheduler.events import Tier, TierEvents
from kv_offload.tier_contract import Place

NAME = "remote"
MAX_TAIL_NOTES = 4096  # tails reserved and not yet written (a bound, like the disk's)
MAX_TAIL_PARENTS = 8  # parents whose tails one asker keeps answered (the oldest dropped)


class RemoteIndex:
    """The scheduler's view of a ``remote.RemoteTier`` (see the module docstring).
    ``disable`` (the connector's reset, ``OffloadScheduler.reset_all``) stops lookups and
    stores for the rest of the run."""

    name = NAME
    keeps_tails = True
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
        self._tail_lookups: Any = None
        self._tail_memo: dict[str, dict[bytes, list[Tail]]] = {}  # asker -> parent -> tails
        self._tail_asked: dict[str, tuple[bytes, ...]] = {}  # asker -> parents in flight
        self._tail_notes: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}  # note_tail
        self._writer: TailWriter | None = None
        self._tails: Any = None  # remote.tail_records(), made once

    def bind(self, counters: Any, clock: Callable[[], float]) -> None:
        """Starts the lookup threads, the chunks' and the tails', which connect now (off
        this thread: a server that is down delays nothing, it only backs off), so that
        the first request's questions pay no import or connection set-up within their
        budget."""
        self._counters, self._clock = counters, clock
        if self._lookups is None:
            self._lookups = self.remote.async_lookups(clock=clock)
            self._tail_lookups = self.remote.async_lookups(
                clock=clock, fetch=self._tail_records().tails_many, miss={}, num_threads=1)
            self._errors = self.remote.health.num_failures

    def find(self, asker: str, keys: Sequence[bytes]) -> list[Place] | None:
        """The leading chunks of ``keys`` the server holds; None while pending."""
        if not self.enabled or not keys:
            return []
        tails = self._tail_memo.get(asker)
        if tails is not None:  # a tail tails_of reported: its values were there
            held = {key for found in tails.values() for key, _ in found}
            return [Place(NAME, k) for k in itertools.takewhile(held.__contains__, keys)]
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
        # Failed round trips and answers past the budget (tails' questions too) since
        # the last answer.
        errors = self._lookups.num_timeouts + self.remote.health.num_failures
        errors += 0 if self._tail_lookups is None else self._tail_lookups.num_timeouts
        self._counters.remote_lookup_errors += max(0, errors - self._errors)
        self._errors = errors
        self._memo[asker] = (asked, hits)
        return [Place(NAME, k) for k in asked[:hits]]

    def forget(self, asker: str) -> None:
        self._memo.pop(asker, None)
        self._tail_memo.pop(asker, None)
        self._tail_asked.pop(asker, None)
        for lookups in (self._lookups, self._tail_lookups):
            if lookups is not None:
                lookups.forget(asker)

    def expect_tails(self, asker: str, parents: Sequence[bytes]) -> None:
        """Start asking for the tails of ``parents`` now, in one question (one round
        trip), unless a question of ``asker``'s is in flight or they are answered already:
        ``tails_of(asker, parent)`` of any of them then answers from it. Never waits; no
        I/O on this thread."""
        if not self.enabled or self._tail_lookups is None or self._lookups.slow:
            return
        self._collect_tails(asker)
        memo = self._tail_memo.get(asker, {})
        new = tuple(p for p in dict.fromkeys(parents) if p not in memo)
        if new and asker not in self._tail_asked:
            self._ask_tails(asker, new)

    def tails_of(self, asker: str, parent: bytes) -> list[Tail] | None:
        """(key, token ids) of the tails of ``parent`` on the server whose record makes
        their key and whose value every rank holds, oldest first; None while pending
        (asked off the scheduler thread, within the lookup budget: past it, none). Asked
        with ``expect_tails``'s parents still in flight when it named others (one question
        replaces the other)."""
        if not self.enabled:
            return []
        self._collect_tails(asker)
        memo = self._tail_memo.get(asker, {})
        if parent in memo:
            return memo[parent]
        asked = self._tail_asked.get(asker, ())
        if parent in asked:
            return None
        if self._lookups.slow:
            return []  # the chunks' questions found the server slow or down: not waited for
        self._ask_tails(asker, (*asked, parent))
        return self._tail_memo.get(asker, {}).get(parent)

    def _ask_tails(self, asker: str, parents: tuple[bytes, ...]) -> None:
        """Ask (or ask again) for the tails of ``parents``: memoised once answered, else
        in flight."""
        began = self._clock()
        found = self._tail_lookups.ask(asker, parents)
        self._counters.seconds_remote_lookup += self._clock() - began
        if found is None:
            self._tail_asked[asker] = parents
            return
        self._tail_asked.pop(asker, None)
        memo = self._tail_memo.setdefault(asker, {})
        for parent in parents:
            memo[parent] = found.get(parent, [])
        while len(memo) > max(MAX_TAIL_PARENTS, len(parents)):  # never those just asked
            del memo[next(iter(memo))]

    def _collect_tails(self, asker: str) -> None:
        """Memoise the answer of ``asker``'s question in flight, if it came."""
        asked = self._tail_asked.get(asker)
        if asked is not None:
            self._ask_tails(asker, asked)  # the same question: its answer, or None

    def num_pending(self) -> int:
        """Questions sent to the server (chunks' and tails') and not answered yet."""
        return sum(lookups.num_pending() for lookups in (self._lookups, self._tail_lookups)
                   if lookups is not None)

    def _tail_records(self) -> RemoteTails:
        if self._tails is None:
            self._tails = self.remote.tail_records()
        return self._tails

    def note_tail(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        """``key`` is a request tail of ``parent``: its record is written once every rank
        wrote its value (``written``). Notes of tails never written age out past
        ``MAX_TAIL_NOTES``."""
        self._tail_notes[key] = (parent, tokens)
        while len(self._tail_notes) > MAX_TAIL_NOTES:
            del self._tail_notes[next(iter(self._tail_notes))]

    def wait_tails_written(self, timeout_s: float = 5.0) -> bool:
        """Block until the tail records queued so far were written (or failed), up to
        ``timeout_s``; whether they were. Not for the scheduler thread (tests)."""
        return self._writer is None or self._writer.wait(timeout_s)

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
        tails = {k: note for k in keys if (note := self._tail_notes.pop(k, None))}
        records = [(parent, k, tokens) for k, (parent, tokens) in tails.items() if k in done]
        if records and self.enabled:
            if self._writer is None:
                self._writer = TailWriter(self._tail_records())
            self._writer.put(records)
        if self._counters is not None:
            self._counters.chunks_stored_remote += len(done)
        if self._events is not None and self.enabled:  # off after reset_all
            self._events.stored(Tier.REMOTE, [k for k in done if k not in tails])
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
        self._tail_memo.clear()
        self._tail_asked.clear()
        if self._events is not None:
            self._events.tier_off(Tier.REMOTE)

    def attach_events(self, events: TierEvents) -> None:
        self._events = events

    def stats(self) -> dict | None:
        """``up``: whether the server answers now (not backing off)."""
        return {"up": self.remote.health.up}

    def close(self) -> None:
        """Write the queued tail records (up to a few seconds), stop the threads, close
        the connections."""
        if self._writer is not None:
            self._writer.close()
        for lookups in (self._lookups, self._tail_lookups):
            if lookups is not None:
                lookups.close()
        self.remote.close()
