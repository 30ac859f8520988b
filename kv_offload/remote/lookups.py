"""RemoteLookups: remote-tier lookups off the scheduler thread, memoised per request.

vLLM asks a connector how many tokens it can load (``get_num_new_matched_tokens``) on
its scheduler thread, once per step while a request waits; answering ``None`` means
"not yet, ask again next step". ``ask`` never touches the network: the first call
queues the request's keys for the lookup threads and answers None; later calls answer
the memoised count once a thread has it, or 0 (a miss) once the request's total
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

The scheduler thread never takes a lock that a lookup thread holds (a lookup thread
descheduled while holding one would stall vLLM's scheduler, and with it every
request): questions go to the threads through a ``queue.SimpleQueue`` (C, never
blocks on put), each thread publishes its answer by setting one attribute of the
question, and everything else (the memo, the counters ``ask`` keeps) belongs to the
scheduler thread alone.

Requests that cannot win from waiting answer 0 at once: no keys (shorter than one
chunk, or every chunk found locally); a server that is backing off, or slow: a round
trip took longer than the budget (one probe is kept in flight, and the first round trip
within the budget ends it). A miss is not remembered beyond its request: a memory of
prefixes found absent (a negative cache) cannot see this engine's own stores, so it hid
chunks stored here and dropped from the CPU tier since
(``reset_prefix_cache(reset_connector=True)``, an eviction) from the request that asked
again within it (seen with a 1 s and with a 500 ms memory).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)

MAX_BATCH = 64  # requests per round trip
_STOP = None  # tells a lookup thread to end
A = TypeVar("A")  # an answer: a count of chunks, or a parent's request tails


class LookupTier(Protocol):
    """What RemoteLookups needs of a RemoteTier (each lookup thread also calls its
    ``warm()``, when it has one, as it starts)."""

    health: Any  # RemoteHealth: ``up`` and ``num_failures``

    def lookup_many(self, requests: Sequence[Sequence[bytes]]) -> list[int]: ...


@dataclass(slots=True, eq=False)
class _Ask:
    """One request's question. ``hits`` is set once, by a lookup thread; ``final`` by
    the scheduler thread when it gives an answer (it never changes)."""

    signature: tuple[bytes, ...]
    keys: Sequence[bytes]
    deadline: float
    hits: Any = None
    final: Any = None


class RemoteLookups(Generic[A]):
    """Asynchronous, memoised remote lookups with a total time budget per request.

    ``ask``, ``forget`` and ``num_pending`` belong to the scheduler thread: they never
    block (no network, no lock shared with the lookup threads). ``budget_s`` bounds,
    from the first ``ask``, how long a request may be answered None. ``start=False``
    runs no thread: ``run_once`` then does a lookup thread's work (tests). ``clock`` is
    injected. ``fetch`` (default: the tier's ``lookup_many``) answers a batch of
    questions in one go on a lookup thread, ``miss`` is the answer of a question that
    failed, timed out or was skipped: the same rules serve another kind of question (the
    remote tier's request tails, ``RemoteTails.tails_many``: ``miss={}``).
    """

    def __init__(self, tier: LookupTier, *, budget_s: float,
                 clock: Callable[[], float] = time.monotonic, num_threads: int = 4,
                 start: bool = True,
                 fetch: Callable[[list[Sequence[bytes]]], list[A]] | None = None,
                 miss: A = 0) -> None:  # type: ignore[assignment]
        if budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {budget_s}")
        self.tier = tier
        self.budget_s = budget_s
        self._clock = clock
        self._fetch: Callable[[list[Sequence[bytes]]], list[A]] = (
            fetch if fetch is not None else tier.lookup_many)  # type: ignore[assignment]
        self._miss = miss
        self._queue: queue.SimpleQueue[_Ask | None] = queue.SimpleQueue()
        self._asks: dict[str, _Ask] = {}
        # Per lookup thread: when its round trip in flight started (None: idle). Each
        # thread writes its own entry; ask() reads a copy.
        self._trips: list[float | None] = [None] * max(1, num_threads)
        self._slow = False  # written by either side; a plain bool
        self._stats_lock = threading.Lock()  # lookup threads only
        self.num_questions = 0  # lookups asked for (sent, or answered from the cache)
        self.num_timeouts = 0  # answered miss because the budget passed
        self._next_timeout_log = float("-inf")  # scheduler thread (_say_timeout)
        self.num_skipped = 0  # answered miss at once: server backing off or slow
        self.num_round_trips = 0  # lookup threads
        self.seconds_round_trips = 0.0  # lookup threads, network included
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"kv-offload-lookup-{i}")
                         for i in range(num_threads if start else 0)]
        for thread in self._threads:
            thread.start()

    # -- scheduler thread --------------------------------------------------------------

    def ask(self, req_id: str, keys: Sequence[bytes]) -> A | None:
        """How many of ``keys``, from the first, the remote tier holds (or ``fetch``'s
        answer); None: not known yet, ask again. Once an int is returned for these keys, the same int is returned
        until ``forget`` or until the request asks about other keys, which starts a new
        question (the keys the local tiers lack may change between two asks while the
        first and the count stay: a question is all of its keys)."""
        if not keys:
            return self._miss
        signature = tuple(keys)
        now = self._clock()
        ask = self._asks.get(req_id)
        if ask is not None and ask.signature == signature:
            return self._answer(ask, now)
        self.num_questions += 1
        ask = _Ask(signature, keys, now + self.budget_s)
        self._asks[req_id] = ask
        if self._slow or not self.tier.health.up:
            self.num_skipped += 1
            ask.final = self._miss
            if self._queue.empty() and all(t is None for t in self._trips):  # one probe
                self._queue.put(ask)
            return self._miss
        self._queue.put(ask)
        return None

    def _answer(self, ask: _Ask, now: float) -> A | None:
        if ask.final is not None:
            return ask.final
        hits = ask.hits
        if hits is not None:
            ask.final = hits
        elif now >= ask.deadline:
            ask.final = self._miss
            self.num_timeouts += 1
            # Slow if the server holds a round trip past the budget; not when this
            # request only queued behind others.
            started = [t for t in list(self._trips) if t is not None]
            if started and now - min(started) >= self.budget_s:
                self._slow = True
            self._say_timeout(now, started)
        return ask.final

    def _say_timeout(self, now: float, started: list[float]) -> None:
        """Log a question answered a miss by its budget: the first, then at most one a
        minute, with what the lookup threads were doing (a round trip held by the server,
        or questions no thread took: threads stalled, or dead)."""
        if now < self._next_timeout_log:
            return
        self._next_timeout_log = now + 60.0
        logger.warning(
            "kv-offload: a remote lookup (%s) passed its budget of %.0f ms and was answered "
            "a miss (%d so far); round trips in flight for %s s, %d questions queued, %d of "
            "%d lookup threads alive. Raise remote_lookup_budget_ms if the server is "
            "slow; otherwise this is a kv-offload bug worth reporting",
            self.tier.__class__.__name__, self.budget_s * 1e3, self.num_timeouts,
            [round(now - t, 3) for t in started] or "none", self._queue.qsize(),
            sum(t.is_alive() for t in self._threads), len(self._threads))

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s memo (finished or aborted). A lookup in flight for it is
        still answered, into nothing."""
        self._asks.pop(req_id, None)

    @property
    def slow(self) -> bool:
        """Whether new questions are answered a miss at once: the server is backing off,
        or a round trip took longer than the budget (until a probe comes back in time)."""
        return self._slow or not self.tier.health.up

    def num_pending(self) -> int:
        """Requests whose question no lookup thread has answered yet (and that were
        not answered by the budget)."""
        return sum(a.final is None and a.hits is None for a in list(self._asks.values()))

    # -- lookup threads ----------------------------------------------------------------

    def run_once(self, slot: int = 0) -> int:
        """Send the queued questions (``MAX_BATCH`` at most) in one round trip and
        publish the answers; how many were sent. A lookup thread's work (``slot``: its
        index); blocks on the network, never on the queue."""
        batch = self._take(block=False)
        if batch:
            self._send(batch, slot)
        return len(batch)

    def _take(self, *, block: bool) -> list[_Ask]:
        """Up to MAX_BATCH questions; waits for the first when ``block``. A _STOP is put
        back for the other threads and ends the batch."""
        batch: list[_Ask] = []
        try:
            item = self._queue.get(block=block)
            while item is not _STOP:
                batch.append(item)
                if len(batch) >= MAX_BATCH:
                    return batch
                item = self._queue.get_nowait()
            self._queue.put(_STOP)
            if not batch:
                raise _Stopped
        except queue.Empty:
            pass
        return batch

    def _send(self, batch: list[_Ask], slot: int) -> None:
        failures = self.tier.health.num_failures
        began = self._clock()
        self._trips[slot] = began
        try:
            results = self._fetch([a.keys for a in batch])
        except Exception:  # a bug, not a server problem: answer misses, keep serving
            logger.exception("kv-offload: remote lookup raised; answering misses")
            results, failures = [self._miss] * len(batch), -1
        finally:
            self._trips[slot] = None
        done = self._clock()
        # A real answer: no failure during the call, and not the zeros a tier that is
        # backing off returns without asking the server.
        genuine = failures == self.tier.health.num_failures and self.tier.health.up
        if genuine:
            self._slow = done - began > self.budget_s
        with self._stats_lock:
            self.num_round_trips += 1
            self.seconds_round_trips += done - began
        for ask, hits in zip(batch, results):
            ask.keys = ()
            ask.hits = hits  # last: publishes the answer

    def _run(self, slot: int) -> None:
        warm = getattr(self.tier, "warm", None)  # optional: connect before the first ask
        if warm is not None:
            try:
                warm()
            except Exception:
                logger.exception("kv-offload: warming the remote lookup connection raised")
        while True:
            try:
                batch = self._take(block=True)
            except _Stopped:
                return
            self._send(batch, slot)

    @property
    def running(self) -> bool:
        """Whether a lookup thread is still alive (False after ``close``)."""
        return any(t.is_alive() for t in self._threads)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the lookup threads (a round trip in flight finishes first, up to
        ``timeout_s``). Pending questions stay unanswered: ``ask`` then answers 0 once
        their budget passed. Does not close the tier."""
        self._queue.put(_STOP)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class _Stopped(Exception):
    """The queue says stop (close)."""
