"""Helpers shared by the worker tests."""

from __future__ import annotations

import sys
import threading
import time


def drain(worker, *, until, timeout=30.0):
    """Poll until ``until(reports, finished, failed)`` holds; returns those three (the
    worker's reports, the finished request ids and the failed block ids so far).
    ``timeout`` bounds a hang only."""
    finished, failed, reports = set(), set(), []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = worker.poll()
        finished |= result.finished_req_ids
        failed |= result.failed_block_ids
        report = worker.take_report()
        if report:
            reports.append(report)
        if until(reports, finished, failed):
            return reports, finished, failed
        time.sleep(0.01)
    raise AssertionError("worker did not finish in time")


def wait_until_blocked(thread: threading.Thread, timeout: float = 30.0) -> None:
    """Return once ``thread`` waits on an event, condition or future (its innermost
    Python frame is a ``wait`` of the threading module) or has ended. For checks that
    something is still waiting: no grace period that a busy host could outlast.
    ``timeout`` bounds a hang only."""
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        frame = sys._current_frames().get(thread.ident)
        if (frame is not None and frame.f_code.co_name == "wait"
                and frame.f_code.co_filename == threading.__file__):
            return
        assert time.monotonic() < deadline, f"{thread.name} neither waits nor ends"
        time.sleep(0.001)
