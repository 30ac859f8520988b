"""DiskHealth: which disk failures make the disk broken, and what is logged."""

from __future__ import annotations

import errno
import logging

from kv_offload.counters import WorkerCounters
from kv_offload.disk.health import DISK_BROKEN_AFTER, DiskHealth
from kv_offload.disk.slab import ReadResult


def test_io_errors_in_a_row_make_the_disk_broken_once():
    health = DiskHealth(rank=3)
    for _ in range(DISK_BROKEN_AFTER - 1):
        assert health.read_failed(7, ReadResult.IO_ERROR) == WorkerCounters(disk_read_errors=1)
    assert health.take_broken() is None
    health.write_failed(OSError(errno.EIO, "Input/output error"))
    broken = health.take_broken()
    assert broken is not None and broken.startswith("rank 3: ") and "Input/output" in broken
    assert health.take_broken() is None
    for _ in range(2 * DISK_BROKEN_AFTER):
        health.read_failed(7, ReadResult.MISSING)
    assert health.take_broken() is None  # reported once per worker


def test_a_success_resets_the_run_of_errors():
    health = DiskHealth(rank=0)
    for i in range(3 * DISK_BROKEN_AFTER):
        health.read_failed(1, OSError(errno.EIO, "boom"))
        if i % (DISK_BROKEN_AFTER - 1) == 0:
            (health.read_ok if i % 2 else health.write_ok)()
    assert health.take_broken() is None


def test_per_chunk_failures_never_make_the_disk_broken():
    """Checksum mismatches, short reads (a slot never written) and a full disk are
    failures of one chunk, not of the disk."""
    health = DiskHealth(rank=0)
    for _ in range(3 * DISK_BROKEN_AFTER):
        assert health.read_failed(1, ReadResult.CHECKSUM_MISMATCH) == WorkerCounters(checksum_failures=1)
        assert health.read_failed(1, ReadResult.SHORT_READ) == WorkerCounters(disk_read_errors=1)
        health.write_failed(OSError(errno.ENOSPC, "No space left on device"))
    assert health.take_broken() is None


def test_a_burst_of_write_failures_is_logged_once(caplog):
    health = DiskHealth(rank=0)
    with caplog.at_level(logging.WARNING, logger="kv_offload.disk.health"):
        for _ in range(5):
            health.write_failed(OSError(errno.ENOSPC, "full"))
        health.write_ok()
        health.write_failed(OSError(errno.ENOSPC, "full"))
    lines = [r.getMessage() for r in caplog.records if "disk write failed" in r.getMessage()]
    assert len(lines) == 2 and "1 failures so far" in lines[0] and "6 failures" in lines[1]
