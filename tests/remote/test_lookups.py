"""RemoteLookups: the scheduler's remote questions, answered off its thread.

Pure bookkeeping with a fake tier and an injected clock (``start=False``: the test runs
the lookup thread's work with ``run_once``), plus one test with the real thread.
Regression scenarios: a slow server held every request of the engine on the
scheduler thread (the old synchronous lookup); the budget was a socket timeout, so a
server answering just within it cost every request that much.
"""

from __future__ import annotations

import threading
import time

import pytest

from kv_offload.remote.health import RemoteHealth
from kv_offload.remote.lookups import MAX_BATCH, RemoteLookups
from kv_offload.testing.clock import FakeClock

BUDGET = 0.020


class FakeTier:
    """Holds ``keys``; each round trip takes ``rtt`` on the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.keys: set[bytes] = set()
        self.health = RemoteHealth("fake", clock=clock)
        self.batches: list[list[list[bytes]]] = []
        self.rtt = 0.001
        self.down = False
        self.raises = False
        self.during = None  # called while the round trip is in flight

    def lookup_many(self, requests):
        self.batches.append([list(r) for r in requests])
        if not self.health.up:  # RemoteTier: zeros without a call while backing off
            return [0] * len(requests)
        if self.during:
            self.during()
        self.clock.now += self.rtt
        if self.raises:
            raise RuntimeError("a bug")
        if self.down:
            self.health.record_failure("down")
            return [0] * len(requests)
        self.health.record_success()
        out = []
        for keys in requests:
            hits = 0
            for k in keys:
                if k not in self.keys:
                    break
                hits += 1
            out.append(hits)
        return out


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


@pytest.fixture
def setup():
    clock = FakeClock(100.0)
    tier = FakeTier(clock)
    lookups = RemoteLookups(tier, budget_s=BUDGET, clock=clock, start=False)
    return lookups, tier, clock


def test_pending_until_the_thread_answers_then_memoised(setup):
    lookups, tier, _ = setup
    tier.keys.update(keys("a", 3))
    ask = keys("a", 5)
    assert lookups.ask("r", ask) is None
    assert lookups.ask("r", ask) is None, "still pending: vLLM asks again next step"
    assert lookups.num_pending() == 1
    assert lookups.run_once() == 1
    assert [lookups.ask("r", ask) for _ in range(3)] == [3, 3, 3]
    assert len(tier.batches) == 1, "one round trip per request however often vLLM asks"
    assert lookups.num_pending() == 0


def test_past_the_budget_a_miss_that_never_changes(setup, caplog):
    lookups, tier, clock = setup
    tier.keys.update(keys("a", 4))
    assert lookups.ask("r", keys("a", 4)) is None
    clock.now += BUDGET
    assert lookups.ask("r", keys("a", 4)) == 0
    assert lookups.num_timeouts == 1
    # said once, with what the lookup threads were doing (none runs in this test)
    assert "passed its budget of 20 ms" in caplog.text and "1 questions queued" in caplog.text
    assert lookups.ask("r2", keys("a", 4)) is None
    clock.now += BUDGET
    assert lookups.ask("r2", keys("a", 4)) == 0 and caplog.text.count("passed its budget") == 1
    lookups.run_once()  # the late answer arrives...
    assert lookups.ask("r", keys("a", 4)) == 0, "...but the request already went on"


def test_after_a_timeout_new_requests_do_not_wait_until_a_probe_is_fast(setup):
    lookups, tier, clock = setup
    tier.keys.update(keys("b", 2))
    lookups.ask("r1", keys("a", 2))
    clock.now += BUDGET
    assert lookups.ask("r1", keys("a", 2)) == 0
    tier.rtt = 0.050  # the server answers, slowly
    lookups.run_once()  # r1's question, answered late
    assert [lookups.ask(f"s{i}", keys("b", 2)) for i in range(3)] == [0, 0, 0]
    assert lookups.num_skipped == 3
    assert lookups.run_once() == 1, "one probe in flight, not one per request"
    assert lookups.ask("s4", keys("b", 2)) == 0, "the probe was slow: still skipping"
    tier.rtt = 0.001
    lookups.run_once()
    assert lookups.ask("s5", keys("b", 2)) is None, "a fast probe: requests wait again"
    lookups.run_once()
    assert lookups.ask("s5", keys("b", 2)) == 2


def test_a_round_trip_held_past_the_budget_makes_new_requests_skip_at_once(setup):
    lookups, tier, clock = setup
    answers = []

    def meanwhile():  # the scheduler keeps stepping while the server holds the reply
        answers.append(lookups.ask("r2", keys("b", 2)))
        clock.now += 2 * BUDGET
        answers.append(lookups.ask("r2", keys("b", 2)))
        answers.append(lookups.ask("r3", keys("c", 2)))

    tier.during = meanwhile
    lookups.ask("r1", keys("a", 2))
    lookups.run_once()
    assert answers == [None, 0, 0], "r2 timed out; the server is slow: r3 does not wait"
    assert lookups.num_skipped == 1


def test_a_request_that_only_queued_past_its_budget_does_not_mark_the_server_slow(setup):
    lookups, tier, clock = setup
    for i in range(MAX_BATCH + 1):
        lookups.ask(f"r{i}", keys(f"q{i}-", 2))
    lookups.run_once()  # a fast round trip; the last request is still queued
    clock.now += BUDGET
    assert lookups.ask(f"r{MAX_BATCH}", keys(f"q{MAX_BATCH}-", 2)) == 0
    assert lookups.ask("next", keys("n", 2)) is None, "the server is not slow"


def test_nothing_to_ask_answers_zero_without_a_lookup(setup):
    lookups, tier, _ = setup
    assert lookups.ask("short", []) == 0
    assert lookups.run_once() == 0 and tier.batches == []


def test_a_miss_is_not_remembered_for_the_next_request():
    """Regression: a negative cache (since removed) with a 1 s (and a 500 ms) memory
    answered a prefix this engine computed and stored right after its lookup, then
    dropped from the CPU tier (reset_connector), a miss again when asked about within
    it: no remote hit."""
    clock = FakeClock(100.0)
    tier = FakeTier(clock)
    lookups = RemoteLookups(tier, budget_s=BUDGET, clock=clock, start=False)
    lookups.ask("cold", keys("m", 3))
    lookups.run_once()
    assert lookups.ask("cold", keys("m", 3)) == 0
    tier.keys.update(keys("m", 3))  # stored by this engine (or another) meanwhile
    assert lookups.ask("again", keys("m", 3)) is None
    lookups.run_once()
    assert lookups.ask("again", keys("m", 3)) == 3


def test_a_failed_lookup_is_a_miss_and_the_next_request_asks_again(setup):
    lookups, tier, _ = setup
    tier.down = True
    lookups.ask("r1", keys("d", 2))
    lookups.run_once()
    assert lookups.ask("r1", keys("d", 2)) == 0
    tier.down = False
    tier.health.record_success()
    assert lookups.ask("r2", keys("d", 2)) is None


def test_server_backing_off_answers_misses_at_once_with_one_probe(setup):
    lookups, tier, _ = setup
    tier.health.record_failure("refused")
    assert [lookups.ask(f"r{i}", keys("e", 2)) for i in range(4)] == [0, 0, 0, 0]
    assert lookups.run_once() == 1 and lookups.run_once() == 0


def test_zeros_of_a_tier_backing_off_are_not_answers(setup):
    """They neither mark the keys cold nor end the skipping."""
    lookups, tier, _ = setup
    tier.keys.update(keys("k", 2))
    tier.health.record_failure("timeout")
    assert lookups.ask("r1", keys("k", 2)) == 0
    lookups.run_once()  # the probe, answered with zeros by the backing-off tier
    assert lookups.ask("r2", keys("k", 2)) == 0 and lookups.num_skipped == 2
    tier.health.record_success()  # the server is back
    assert lookups.ask("r3", keys("k", 2)) is None, "not remembered as cold"
    lookups.run_once()
    assert lookups.ask("r3", keys("k", 2)) == 2


def test_a_new_question_when_the_request_asks_about_other_keys(setup):
    lookups, tier, _ = setup
    tier.keys.update(keys("f", 4))
    lookups.ask("r", keys("f", 2))
    lookups.run_once()
    assert lookups.ask("r", keys("f", 2)) == 2
    assert lookups.ask("r", keys("f", 4)) is None, "more keys: asked again"
    lookups.run_once()
    assert lookups.ask("r", keys("f", 4)) == 4
    lookups.forget("r")
    assert lookups.ask("r", keys("f", 4)) is None, "forgotten: a new question"


def test_requests_asked_meanwhile_share_one_round_trip(setup):
    lookups, tier, _ = setup
    for i in range(MAX_BATCH + 3):
        lookups.ask(f"r{i}", keys(f"g{i}-", 2))
    assert lookups.run_once() == MAX_BATCH
    assert lookups.run_once() == 3
    assert [len(b) for b in tier.batches] == [MAX_BATCH, 3]


def test_a_tier_that_raises_gives_misses_and_the_service_goes_on(setup, caplog):
    lookups, tier, _ = setup
    tier.raises = True
    lookups.ask("r", keys("h", 2))
    lookups.run_once()
    assert lookups.ask("r", keys("h", 2)) == 0
    assert "remote lookup raised" in caplog.text


def test_budget_must_be_positive(setup):
    _, tier, _ = setup
    with pytest.raises(ValueError, match="budget_s"):
        RemoteLookups(tier, budget_s=0, start=False)


class BlockingTier:
    """A server that holds every reply until the test releases it."""

    def __init__(self) -> None:
        self.health = RemoteHealth("blocking")
        self.entered = threading.Event()
        self.release = threading.Event()

    def lookup_many(self, requests):
        self.entered.set()
        assert self.release.wait(60), "never released"
        return [len(r) for r in requests]


def test_the_scheduler_thread_never_waits_for_the_server():
    tier = BlockingTier()
    lookups = RemoteLookups(tier, budget_s=60.0, clock=lambda: 0.0)  # no budget passes
    try:
        assert lookups.ask("slow", keys("i", 3)) is None
        assert tier.entered.wait(30), "the lookup thread took the question"
        # While the server holds its reply, other requests are answered at once.
        assert lookups.ask("slow", keys("i", 3)) is None
        assert lookups.ask("short", []) == 0
        assert lookups.ask("other", keys("j", 2)) is None
        tier.release.set()
        deadline = time.monotonic() + 30  # bounds a hang only
        while lookups.num_pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lookups.ask("slow", keys("i", 3)) == 3
        assert lookups.ask("other", keys("j", 2)) == 2
    finally:
        tier.release.set()
        lookups.close()
    assert not lookups.running, "close stops every lookup thread"
