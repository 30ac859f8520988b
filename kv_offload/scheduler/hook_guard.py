"""HookGuard: keeps an exception in kv-offload's scheduler side out of vLLM.

vLLM calls the connector's scheduler hooks inside ``Scheduler.schedule()`` and
``update_from_output()``; an exception there kills the engine core. A hook run through
``HookGuard.call`` returns its fallback instead (a miss, an empty plan), the error is
logged once per hook with its traceback, and every occurrence is counted
(``SchedulerCounters.hook_errors``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from kv_offload.counters import SchedulerCounters

T = TypeVar("T")
logger = logging.getLogger("kv_offload")


class HookGuard:
    """Runs connector hooks, turning any exception into the hook's fallback value.

    Scheduler thread only. ``counters.hook_errors`` counts every caught exception; the
    first one of each hook is logged with its traceback, the others only counted.
    """

    def __init__(self, counters: SchedulerCounters) -> None:
        self.counters = counters
        self._logged: set[str] = set()

    def call(self, hook: str, fallback: Callable[[], T], fn: Callable[..., T], *args: object
             ) -> T | None:
        """``fn(*args)``, or ``fallback()`` if it raised (itself guarded: a failing
        fallback is logged too, and the hook answers None)."""
        try:
            return fn(*args)
        except Exception:
            self._note(hook)
        try:
            return fallback()
        except Exception:
            self._note(f"{hook} (fallback)")
            return None

    def _note(self, hook: str) -> None:
        self.counters.hook_errors += 1
        if hook in self._logged:
            return
        self._logged.add(hook)
        logger.exception(
            "kv-offload: the connector hook %s failed; kv-offload answers a miss (the "
            "tokens are recomputed) and vLLM keeps serving. This is a kv-offload bug: "
            "please report it with this traceback. Later errors of this hook are only "
            "counted (hook_errors).", hook)
