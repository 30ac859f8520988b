"""RemoteHealth: a failing server costs one call per backoff period, then one probe."""

from __future__ import annotations

import logging
import threading

from kv_offload.remote.health import RemoteHealth
from kv_offload.testing.clock import FakeClock


def test_backoff_doubles_until_the_cap_and_resets_on_success():
    clock = FakeClock(100.0)
    health = RemoteHealth("test", min_backoff_s=1, max_backoff_s=4, clock=clock)
    assert health.should_try() and health.up
    waits = []
    for _ in range(4):
        health.record_failure("refused")
        start = clock.now
        while not health.should_try():
            clock.now += 0.25
        waits.append(clock.now - start)
    assert waits == [1, 2, 4, 4]
    health.record_success()
    assert health.up and health.should_try()
    health.record_failure("refused")
    clock.now += 1
    assert health.should_try(), "backoff starts again from the minimum"


def test_only_one_probe_at_a_time_while_down():
    clock = FakeClock(100.0)
    health = RemoteHealth("test", min_backoff_s=1, clock=clock)
    health.record_failure("timeout")
    clock.now += 2
    results = []
    threads = [threading.Thread(target=lambda: results.append(health.should_try()))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1


def test_a_burst_of_failures_logs_once_and_recovery_once(caplog):
    clock = FakeClock(100.0)
    health = RemoteHealth("redis://x", clock=clock)
    with caplog.at_level(logging.WARNING, logger="kv_offload.remote.health"):
        for _ in range(50):
            health.record_failure("refused")
        health.record_success()
        health.record_success()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "failed" in lines[0] and "back" in lines[1]
    assert health.num_failures == 50


def test_calls_in_flight_when_the_server_goes_away_count_as_one_outage():
    """Eight reads failing together backed off 30 s (doubling per failed call) instead
    of 0.5 s: one server restart took the tier off for half a minute."""
    clock = FakeClock(100.0)
    health = RemoteHealth("t", min_backoff_s=0.5, max_backoff_s=30, clock=clock)
    assert all(health.should_try() for _ in range(8))
    for _ in range(8):
        health.record_failure("ConnectionError")
    clock.now += 0.6
    assert health.should_try(), "one outage backs off min_backoff_s"
    health.record_failure("still down")  # the probe failed: now it doubles
    clock.now += 0.6
    assert not health.should_try()
    clock.now += 0.5
    assert health.should_try()
