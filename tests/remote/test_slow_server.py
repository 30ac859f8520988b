"""RemoteLookups against a real Redis made slow by a delaying proxy (50-200 ms a reply).

Regression scenario: lookups ran on vLLM's scheduler thread and their budget was a
socket timeout, so a server answering slowly but within it cost every request that
long, and a server slower than that cost one timeout per request. Now a request is
answered "pending" at once, a miss once its budget passed, and while the server is
slow new requests get a miss at once; a probe notices when it is fast again.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kv_offload.remote import RemoteTarget, RemoteTier
from kv_offload.remote.lookups import RemoteLookups
from kv_offload.testing.clock import FakeClock
from kv_offload.testing.redis_server import SlowProxy

NS = "5e" * 16
SLOT = 1024
BUDGET = 0.020


def chunk_key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@pytest.fixture
def slow(redis_server):
    """(proxy, a tier through it); chunks 0-3 are stored (directly)."""
    direct = RemoteTier(RemoteTarget(redis_server.url), namespace=NS, num_ranks=1,
                        payload_bytes=SLOT, timeout_s=1.0)
    for i in range(4):
        assert direct.write(chunk_key(i), 0, memoryview(np.full(SLOT, i, np.uint8)))
    direct.close()
    with SlowProxy(redis_server.port, delay_s=(0.05, 0.2)) as proxy:
        tier = RemoteTier(RemoteTarget(proxy.url), namespace=NS, num_ranks=1,
                          payload_bytes=SLOT, timeout_s=2.0)
        tier.health.min_backoff_s = 0.05
        yield proxy, tier
        tier.close()


def gate_lookups(tier: RemoteTier) -> tuple[threading.Event, threading.Event]:
    """Hold ``tier``'s round trips at their start until the test sets ``release``;
    ``entered`` is set once one began (the lookup thread is in it)."""
    entered, release = threading.Event(), threading.Event()
    lookup_many = tier.lookup_many

    def gated(requests):
        entered.set()
        assert release.wait(60), "the test never released the round trip"
        return lookup_many(requests)

    tier.lookup_many = gated
    return entered, release


def wait_for(lookups: RemoteLookups, req_id: str, keys: list[bytes], timeout_s: float = 30):
    """``lookups.ask`` until it answers; ``timeout_s`` bounds a hang only."""
    deadline = time.monotonic() + timeout_s
    while (answer := lookups.ask(req_id, keys)) is None:
        assert time.monotonic() < deadline, "never answered"
        time.sleep(0.002)
    return answer


def test_slow_replies_are_misses_after_the_budget_and_do_not_hold_new_requests(slow):
    """The first round trip is held in flight (a gate, then the proxy's delay) while the
    budget passes on the lookups' clock: its request answers a miss, and while the
    server is known slow new requests miss at once; once the path is fast, a probe
    (a round trip within the budget) brings the lookups back."""
    proxy, tier = slow
    keys = [chunk_key(i) for i in range(4)]
    clock = FakeClock()
    entered, release = gate_lookups(tier)
    lookups = RemoteLookups(tier, budget_s=BUDGET, clock=clock)
    try:
        assert lookups.ask("first", keys) is None, "the scheduler thread does not wait"
        assert entered.wait(30), "no lookup thread took the question"
        clock.now += 10 * BUDGET  # the round trip is still in flight
        assert lookups.ask("first", keys) == 0, "past the budget: a miss"
        assert lookups.num_timeouts == 1
        # The server is known slow: new requests are not held (misses at once).
        answers = [lookups.ask(f"r{i}", keys) for i in range(20)]
        assert answers == [0] * 20
        proxy.delay_s = (0.0, 0.0)  # the path is fast again
        release.set()
        deadline = time.monotonic() + 30  # bounds a hang only
        while lookups.ask(f"probe{time.monotonic()}", keys) == 0:  # probes notice it
            assert time.monotonic() < deadline, "the lookups never came back"
            time.sleep(0.01)
        assert wait_for(lookups, "after", keys) == 4
    finally:
        release.set()
        lookups.close()


def test_with_the_budget_as_socket_timeout_a_slow_server_backs_off(slow):
    """The connector gives the scheduler's tier the budget as its socket timeout too:
    a reply slower than that is a failure, and the tier backs off."""
    proxy, _ = slow
    proxy.delay_s = (0.5, 0.5)  # 25 budgets: a reply never makes it in time
    tier = RemoteTier(RemoteTarget(proxy.url), namespace=NS, num_ranks=1,
                      payload_bytes=SLOT, timeout_s=BUDGET)
    lookups = RemoteLookups(tier, budget_s=BUDGET)
    keys = [chunk_key(i) for i in range(2)]
    try:
        assert wait_for(lookups, "first", keys) == 0
        deadline = time.monotonic() + 30  # bounds a hang only
        while tier.health.up:
            assert time.monotonic() < deadline, "a timed-out lookup must count as a failure"
            time.sleep(0.01)
        assert [lookups.ask(f"r{i}", keys) for i in range(10)] == [0] * 10
    finally:
        lookups.close()
        tier.close()
