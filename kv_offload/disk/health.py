"""DiskHealth: one rank's account of failed disk reads and writes.

A failed read or write is a miss or a skipped store, never an error for vLLM; this
class decides what is logged (a read failure the first time and every 1000th, a write
failure once per burst of them) and when the disk is broken: after DISK_BROKEN_AFTER
I/O errors in a row. Checksum mismatches and a full disk (ENOSPC) are per chunk and do
not count towards it. Thread-safe (called from the worker's I/O threads).
"""

from __future__ import annotations

import errno
import logging
import threading

from kv_offload.counters import WorkerCounters
from kv_offload.disk.slab import ReadResult

logger = logging.getLogger(__name__)

DISK_BROKEN_AFTER = 8  # consecutive I/O errors (not checksum mismatches) before giving up
_BROKEN_ERRNOS = {errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EBADF,
                  errno.ENOTDIR, errno.ESTALE}
# Reads that count towards DISK_BROKEN_AFTER (a short read is one slot never written).
_IO_ERROR_READS = (ReadResult.IO_ERROR, ReadResult.MISSING)


class DiskHealth:
    """Counts one rank's disk I/O failures (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._read_failures = 0
        self._write_errors = 0
        self._write_burst = False  # the last write failed (a failure burst is logged once)
        self._io_errors_in_a_row = 0
        self._broken: str | None = None  # why the disk is broken, until taken
        self._broken_reported = False

    def read_ok(self) -> None:
        self._note(ok=True, io_error=False, what="")

    def read_failed(self, disk_slot: int, result: ReadResult | Exception) -> WorkerCounters:
        """Account a read that did not give the chunk; returns the counter delta to add
        (one ``checksum_failures`` or one ``disk_read_errors``)."""
        mismatch = result is ReadResult.CHECKSUM_MISMATCH
        io_error = isinstance(result, Exception) or result in _IO_ERROR_READS
        self._note(ok=False, io_error=io_error, what=str(result))
        with self._lock:
            self._read_failures += 1
            failures = self._read_failures
        if failures == 1 or failures % 1000 == 0:
            logger.warning(
                "kv-offload: disk chunk in slot %d could not be read (%s); its tokens "
                "are recomputed and the entry is dropped (%d failures so far)",
                disk_slot, result, failures)
        # Anything else is an I/O error, the slab file missing or cut short.
        return (WorkerCounters(checksum_failures=1) if mismatch
                else WorkerCounters(disk_read_errors=1))

    def write_ok(self) -> None:
        self._note(ok=True, io_error=False, what="")
        with self._lock:
            self._write_burst = False

    def write_failed(self, exc: Exception) -> None:
        """Account a write that raised ``exc``: a full disk (ENOSPC and other errnos
        outside _BROKEN_ERRNOS) only for this chunk, any other error also counts towards
        DISK_BROKEN_AFTER."""
        per_chunk = isinstance(exc, OSError) and exc.errno not in _BROKEN_ERRNOS
        self._note(ok=False, io_error=not per_chunk, what=str(exc))
        with self._lock:
            self._write_errors += 1
            first_of_burst, self._write_burst = not self._write_burst, True
            errors = self._write_errors
        if first_of_burst:
            logger.warning(
                "kv-offload: disk write failed (%s); %d failures so far; the chunk "
                "stays in the CPU tier only (logged again after writes recover)",
                exc, errors)

    def take_broken(self) -> str | None:
        """Why the disk is broken ("rank R: <last error>"), once; None otherwise."""
        with self._lock:
            broken, self._broken = self._broken, None
        return broken

    def _note(self, *, ok: bool, io_error: bool, what: str) -> None:
        with self._lock:
            if ok:
                self._io_errors_in_a_row = 0
                return
            if not io_error:
                return
            self._io_errors_in_a_row += 1
            if self._io_errors_in_a_row >= DISK_BROKEN_AFTER and not self._broken_reported:
                self._broken_reported = True
                self._broken = f"rank {self.rank}: {what}"
