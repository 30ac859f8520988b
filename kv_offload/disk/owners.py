"""Owners of slot reservations: which process reserved a slot, and is it still running.

A reservation names its owner by (pid, process start time, instance token): the start
time tells a recycled pid apart, the token tells DiskIndex objects of one process apart.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Set

import psutil

from kv_offload.disk.records import Owner


def process_identity(pid: int) -> tuple[bool, int]:
    """(alive, start time in clock ticks since boot, or 0 if unknown) of ``pid``.

    Zombies are dead. The start time is in the unit of ``/proc/<pid>/stat`` on Linux, so
    that reservations written by earlier kv-offload versions keep matching.
    """
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False, 0
        started = proc.create_time()
    except psutil.NoSuchProcess:  # also ZombieProcess
        return False, 0
    except psutil.AccessDenied:
        return True, 0
    return True, round((started - psutil.boot_time()) * _clock_ticks())


def alive_owner(live_tokens: Set[int]) -> Callable[[Owner], bool]:
    """Predicate: is a reservation's owner still running? In this process: is its token
    in ``live_tokens`` (that DiskIndex is still open)? Elsewhere: is the pid alive with
    the same start time? Each pid is looked up once per predicate."""
    own_pid = os.getpid()
    seen: dict[int, tuple[bool, int]] = {}

    def alive(owner: Owner) -> bool:
        pid, start, token = owner
        if pid == own_pid:
            return token in live_tokens
        if pid not in seen:
            seen[pid] = process_identity(pid)
        running, now_start = seen[pid]
        return running and (not start or not now_start or start == now_start)

    return alive


@functools.cache
def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100
