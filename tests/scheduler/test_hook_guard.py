"""HookGuard: an exception in a scheduler hook is a miss, logged once per hook."""

import logging

from kv_offload.counters import SchedulerCounters
from kv_offload.scheduler.hook_guard import HookGuard


def boom(*_):
    raise RuntimeError("planner bug")


def test_an_exception_is_the_fallback_logged_once_per_hook_and_counted(caplog):
    counters = SchedulerCounters()
    guard = HookGuard(counters)
    with caplog.at_level(logging.ERROR, logger="kv_offload"):
        assert guard.call("lookup", lambda: 0, boom, "req") == 0
        assert guard.call("lookup", lambda: 0, boom, "req") == 0
        assert guard.call("plan", list, boom) == []
    assert counters.hook_errors == 3
    lines = [r for r in caplog.records if "connector hook" in r.getMessage()]
    assert [r.getMessage().split(" failed")[0] for r in lines] == [
        "kv-offload: the connector hook lookup", "kv-offload: the connector hook plan"]
    assert lines[0].exc_info is not None, "with its traceback"


def test_a_hook_that_works_returns_its_value_and_a_failing_fallback_is_none():
    counters = SchedulerCounters()
    guard = HookGuard(counters)
    assert guard.call("lookup", lambda: 0, lambda x: x + 1, 41) == 42
    assert guard.call("lookup", boom, boom) is None
    assert counters.hook_errors == 2
