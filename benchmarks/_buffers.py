"""The I/O benchmarks' buffers and files (bench_tiers, bench_remote): page-aligned byte
arrays cut into chunks, files flushed and dropped from the page cache."""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

KiB, MiB = 1 << 10, 1 << 20


def prefaulted(nbytes: int) -> np.ndarray:
    """A page-aligned byte array (O_DIRECT needs alignment), its pages faulted in."""
    arr = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    arr[:] = 1
    return arr


def chunk_views(buf: np.ndarray, chunk: int) -> list[memoryview]:
    """``buf`` cut into whole chunks of ``chunk`` bytes."""
    view = memoryview(buf)
    return [view[i : i + chunk] for i in range(0, buf.nbytes - chunk + 1, chunk)]


def fsync_files(paths: Any, evict: bool = False) -> None:
    """fsync ``paths``; ``evict``: then drop their clean pages from the page cache (the
    next read goes to the device; works unprivileged, leaves other files alone)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if evict:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
