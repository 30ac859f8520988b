"""The remote tier's lookup threads start, and connect, when the engine starts.

Regression scenario: the lookup threads started with the first request's question, so
that question also paid for connecting (importing redis-py, the TCP and TLS handshakes,
the cluster topology) within its lookup budget; on a loaded host it passed the budget,
the request missed chunks the server held, and the slow round trip made the next
request skip the server too (an e2e test needed a 5 s budget). A server that is down
at engine start must still delay nothing: the tier backs off and answers misses.
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

from planner_support import BLOCK, CHUNK, make_request

from kv_offload.remote.health import RemoteHealth
from kv_offload.remote.index import RemoteIndex
from kv_offload.remote.lookups import RemoteLookups
from kv_offload.remote.tier import RemoteTarget, RemoteTier
from kv_offload.scheduler import OffloadScheduler, PlannerConfig
from kv_offload.testing.clock import FakeClock

BUDGET = 0.050  # the default remote_lookup_budget_ms


class SlowToConnect:
    """A server that holds ``keys``; the first call connects, which takes twice the
    lookup budget on the fake clock; a lookup takes 1 ms."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.health = RemoteHealth("fake", clock=clock)
        self.keys: set[bytes] = set()
        self.connected = threading.Event()

    def _connect(self) -> None:
        if not self.connected.is_set():
            self.clock.now += 2 * BUDGET
            self.connected.set()

    def warm(self) -> bool:  # RemoteTier.warm: what each lookup thread calls first
        self._connect()
        return True

    def lookup_many(self, requests):
        self._connect()
        self.clock.now += 0.001
        out = []
        for keys in requests:
            hits = 0
            while hits < len(keys) and keys[hits] in self.keys:
                hits += 1
            out.append(hits)
        return out

    def async_lookups(self, *, clock, **kwargs) -> RemoteLookups:
        kwargs.setdefault("num_threads", 1)
        return RemoteLookups(self, budget_s=BUDGET, clock=clock, **kwargs)

    def tail_records(self):  # no request tails here (partial_hits off)
        return SimpleNamespace(tails_many=lambda questions: [{} for _ in questions])

    def close(self) -> None:
        pass


def engine(remote, clock) -> OffloadScheduler:
    """What the connector builds at engine start: the scheduler over the remote tier."""
    config = PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                           num_ranks=1, num_cpu_slots=16)
    return OffloadScheduler(config, tiers=[RemoteIndex(remote)], block_ids_of=lambda r: [],
                            clock=clock)


def answer_of(sched, request):
    """vLLM asking step after step until the remote answer is in."""
    deadline = time.monotonic() + 30  # bounds a hang only
    while (answer := sched.num_matched_tokens(request, 0)) is None:
        assert time.monotonic() < deadline, "the remote lookup never answered"
        time.sleep(0.001)
    return answer


def test_the_first_request_after_engine_start_is_answered_within_the_budget():
    clock = FakeClock(100.0)
    remote = SlowToConnect(clock)
    sched = engine(remote, clock)
    try:
        assert remote.connected.wait(30), "connected at engine start, before any request"
        request = make_request("first", list(range(17)))  # two chunks on the server
        remote.keys.update([request.block_hashes[1], request.block_hashes[3]])
        asked_at = clock.now
        assert answer_of(sched, request) == 16
        assert clock.now - asked_at < BUDGET, "the question paid no connection set-up"
        assert sched.counters.remote_lookup_errors == 0
        follower = make_request("next", list(range(17)))
        assert answer_of(sched, follower) == 16, "the server is not taken for slow"
    finally:
        sched.close()


def test_a_server_down_at_engine_start_delays_nothing_and_answers_misses(caplog):
    """The connection attempt hangs (a host that drops packets) while the engine starts
    and serves; once it fails, the tier backs off with its warning and answers misses."""
    connecting, refuse = threading.Event(), threading.Event()

    def connect(target, timeout_s):
        connecting.set()
        refuse.wait(60)
        raise ConnectionRefusedError("connection refused")

    clock = FakeClock(100.0)  # the backoff never ends
    remote = RemoteTier(RemoteTarget("redis://10.255.255.1:6379/0"), namespace="ns",
                        num_ranks=1, payload_bytes=64, timeout_s=2.0, lookup_budget_s=BUDGET,
                        connect=connect, clock=clock, who="scheduler")
    caplog.set_level(logging.WARNING, logger="kv_offload.remote.health")
    sched = engine(remote, clock)  # returns while connecting hangs
    try:
        assert connecting.wait(30), "the lookup threads connect at engine start"
        waiting = make_request("waiting", list(range(17)))
        assert sched.num_matched_tokens(waiting, 0) is None, "asked, not waited for"
        assert sched.num_matched_tokens(make_request("short", [1, 2, 3]), 0) == 0
        refuse.set()
        assert answer_of(sched, waiting) == 0, "a miss: the prompt is computed"
        assert not remote.health.up
        assert "remote tier redis://10.255.255.1:6379/0 (scheduler) failed" in caplog.text
        later = make_request("later", list(range(100, 117)))
        assert sched.num_matched_tokens(later, 0) == 0, "skipped at once while backing off"
    finally:
        refuse.set()
        sched.close()
