"""Helpers shared by the worker tests."""

from __future__ import annotations

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
