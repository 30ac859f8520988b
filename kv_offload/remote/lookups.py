"""RemoteLookups: remote-tier lookups off the scheduler thread, memoised per request.

vLLM asks a connector how many tokens it can load (``get_num_new_matched_tokens``) on
its scheduler thread, once per step while a request waits; answering ``None`` means
"not yet, ask again next step". ``ask`` never touches the network: the first call
queues the request's keys for the lookup thread and answers None; later calls answer
the memoised count once the thread has it, or 0 (a miss) once the request's total
budget has passed. A request is never held longer than the budget, and no other
request waits for it.

Why threads and not an asyncio client: vLLM's scheduler is synchronous, so an event
loop would need a thread of its own anyway, and redis-py's synchronous client already
does what we need (AUTH, TLS, cluster topology, our RESP fast path). Each lookup thread
drains the whole queue into one pipelined batch (``RemoteTier.lookup_many``: one round
trip for every request that arrived meanwhile, per cluster node), so lookups never fall
behind however many requests arrive; a few threads (``num_threads``, each on its own
pooled connection) keep a request that arrives during a round trip from waiting for
that one to finish before its own starts (with a round trip near the budget, one thread
made half the requests miss).

Requests that cannot win from waiting answer 0 at once: no keys (shorter than one
chunk, or every chunk found locally); a first key found absent less than
``negative_ttl_s`` ago (a small negative cache: prompts just found cold); a server
that is backing off, or slow: a round trip took longer than the budget (one probe is
kept in flight, and the first round trip within the budget ends it).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

MAX_BATCH = 64  # requests per round trip


class LookupTier(Protocol):
    """What RemoteLookups needs of a RemoteTier (each lookup thread also calls its
    ``warm()``, when it has one, as it starts)."""

    health: Any  # RemoteHealth: ``up`` and ``num_failures``

    def lookup_many(self, requests: Sequence[Sequence[bytes]]) -> list[int]: ...


@dataclass(slots=True)
class _Ask:
    """One request's question: ``keys`` until the thread took them; ``hits`` once it
    answered; ``final`` once the scheduler was given an answer (it never changes)."""

    signature: tuple[bytes, int]
    keys: Sequence[bytes]
    deadline: float
    hits: int | None = None
    final: int | None = None


class RemoteLookups:
    """Asynchronous, memoised remote lookups with a total time budget per request.

    ``ask`` and ``forget`` run on the scheduler thread and never block on the network
    (a short lock shared with the lookup threads). ``budget_s`` bounds, from the first
    ``ask``, how long a request may be answered None. ``start=False`` runs no thread:
    ``run_once`` then does a lookup thread's work (tests). ``clock`` is injected.
    """

    def __init__(self, tier: LookupTier, *, budget_s: float,
                 clock: Callable[[], float] = time.monotonic, negative_ttl_s: float = 1.0,
                 negative_size: int = 4096, num_threads: int = 4, start: bool = True
                 ) -> None:
        if budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {budget_s}")
        self.tier = tier
        self.budget_s = budget_s
        self.negative_ttl_s = negative_ttl_s
        self.negative_size = negative_size
        self._clock = clock
        self._cond = threading.Condition()
        self._asks: dict[str, _Ask] = {}
        self._queue: list[_Ask] = []
        self._in_flight: dict[int, float] = {}  # round trip -> when it started
        self._round_trip_ids = itertools.count()
        self._slow = False
        self._cold: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._closed = False
        self.num_questions = 0  # lookups asked for (sent, or answered from the cache)
        self.num_timeouts = 0  # answered miss because the budget passed
        self.num_cold_hits = 0  # answered miss from the negative cache
        self.num_skipped = 0  # answered miss at once: server backing off or slow
        self.num_round_trips = 0
        self.seconds_round_trips = 0.0  # lookup thread, network included
        self._threads = [threading.Thread(target=self._run, name=f"kv-offload-lookup-{i}",
                                          daemon=True) for i in range(num_threads if start else 0)]
        for thread in self._threads:
            thread.start()

    # -- scheduler thread --------------------------------------------------------------

    def ask(self, req_id: str, keys: Sequence[bytes]) -> int | None:
        """How many of ``keys``, from the first, the remote tier holds; None: not known
        yet, ask again. Once an int is returned for these keys, the same int is returned
        until ``forget`` or until the request asks about other keys (another first key
        or count), which starts a new question."""
        if not keys:
            return 0
        signature = (keys[0], len(keys))
        now = self._clock()
        with self._cond:
            ask = self._asks.get(req_id)
            if ask is not None and ask.signature == signature:
                return self._answer(ask, now)
            self.num_questions += 1
            ask = _Ask(signature, keys, now + self.budget_s)
            self._asks[req_id] = ask
            if self._is_cold(keys[0], now):
                self.num_cold_hits += 1
                ask.final, ask.keys = 0, ()
                return 0
            if self._slow or not self.tier.health.up:
                self.num_skipped += 1
                ask.final = 0
                if not (self._queue or self._in_flight):  # one probe at a time
                    self._queue.append(ask)
                    self._cond.notify()
                return 0
            self._queue.append(ask)
            self._cond.notify()
            return None

    def _answer(self, ask: _Ask, now: float) -> int | None:
        if ask.final is None:
            if ask.hits is not None:
                ask.final = ask.hits
            elif now >= ask.deadline:
                ask.final = 0
                self.num_timeouts += 1
                # Slow if the server holds a round trip past the budget; not when this
                # request only queued behind others.
                if self._in_flight and now - min(self._in_flight.values()) >= self.budget_s:
                    self._slow = True
            else:
                return None
        return ask.final

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s memo (finished or aborted). A lookup in flight for it is
        still answered, into nothing."""
        with self._cond:
            self._asks.pop(req_id, None)

    def num_pending(self) -> int:
        """Requests whose question the lookup thread has not answered yet (and that
        were not answered by the budget)."""
        with self._cond:
            return sum(a.final is None and a.hits is None for a in self._asks.values())

    def _is_cold(self, key: bytes, now: float) -> bool:
        until = self._cold.get(key)
        if until is None:
            return False
        if now < until:
            return True
        del self._cold[key]
        return False

    # -- lookup thread -----------------------------------------------------------------

    def run_once(self) -> int:
        """Send every queued question (``MAX_BATCH`` at a time) and memoise the answers;
        how many were sent. The lookup thread's work; blocks on the network."""
        with self._cond:
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            if not batch:
                return 0
            trip, began = next(self._round_trip_ids), self._clock()
            self._in_flight[trip] = began
        try:
            self._send(batch, began)
        finally:
            with self._cond:
                del self._in_flight[trip]
        return len(batch)

    def _send(self, batch: list[_Ask], began: float) -> None:
        failures = self.tier.health.num_failures
        try:
            results = self.tier.lookup_many([a.keys for a in batch])
        except Exception:  # a bug, not a server problem: answer misses, keep serving
            logger.exception("kv-offload: remote lookup raised; answering misses")
            results = [0] * len(batch)
            failures = -1
        done = self._clock()
        # A real answer: no failure during the call, and not the zeros a tier that is
        # backing off returns without asking the server.
        answered = failures == self.tier.health.num_failures and self.tier.health.up
        with self._cond:
            self.num_round_trips += 1
            self.seconds_round_trips += done - began
            if answered:
                self._slow = done - began > self.budget_s
            for ask, hits in zip(batch, results):
                if answered and hits == 0:
                    self._remember_cold(ask.keys[0], done)
                ask.hits, ask.keys = hits, ()

    def _remember_cold(self, key: bytes, now: float) -> None:
        if self.negative_ttl_s <= 0 or self.negative_size <= 0:
            return
        self._cold[key] = now + self.negative_ttl_s
        self._cold.move_to_end(key)
        while len(self._cold) > self.negative_size:
            self._cold.popitem(last=False)

    def _run(self) -> None:
        warm = getattr(self.tier, "warm", None)  # optional: connect before the first ask
        if warm is not None:
            try:
                warm()
            except Exception:
                logger.exception("kv-offload: warming the remote lookup connection raised")
        while True:
            with self._cond:
                while not (self._queue or self._closed):
                    self._cond.wait()
                if self._closed:
                    return
            self.run_once()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the lookup thread (a round trip in flight finishes first, up to
        ``timeout_s``). Pending questions stay unanswered: ``ask`` then answers 0 once
        their budget passed. Does not close the tier."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
