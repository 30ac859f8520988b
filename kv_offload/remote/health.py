"""RemoteHealth: when to talk to the remote server, with backoff after failures.

Pure logic with an injected clock; thread-safe. One failure takes the tier "down":
lookups answer miss and stores are skipped without touching the network until the
backoff ends; then one call probes the server. Backoff doubles per failed probe
(``min_backoff_s`` .. ``max_backoff_s``) and resets on the first success. Each
down/up transition is logged once, so a dead server gives one warning per burst, not
one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class RemoteHealth:
    """Tracks one process's view of the remote server ("who" names it in logs)."""

    def __init__(self, who: str, *, min_backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.who = who
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = 0.0
        self._probing = False
        self.num_failures = 0

    @property
    def up(self) -> bool:
        return self._down_since is None

    def should_try(self) -> bool:
        """True when a call may go to the server now: it is up, or the backoff ended
        and no other thread is probing (then this caller is the probe)."""
        with self._lock:
            if self._down_since is None:
                return True
            if self._probing or self._clock() < self._retry_at:
                return False
            self._probing = True
            return True

    def record_success(self) -> None:
        with self._lock:
            was_down, self._down_since = self._down_since, None
            self._backoff, self._probing = 0.0, False
        if was_down is not None:
            logger.warning("kv-offload: remote tier %s is back after %.1fs", self.who,
                           self._clock() - was_down)

    def record_failure(self, error: object) -> None:
        """Count a failed call (connection refused, timeout, server error) and back off.
        The first failure backs off ``min_backoff_s``; only a failure after the backoff
        ended (the probe) doubles it: calls that were in flight when the server went
        away fail together and count as one outage."""
        with self._lock:
            self.num_failures += 1
            now = self._clock()
            first = self._down_since is None
            if first:
                self._down_since = now
                self._backoff = self.min_backoff_s
            elif now >= self._retry_at:
                self._backoff = min(self.max_backoff_s, max(self.min_backoff_s,
                                                            self._backoff * 2))
            else:
                return
            self._retry_at = now + self._backoff
            self._probing = False
        if first:
            logger.warning(
                "kv-offload: remote tier %s failed (%s); its lookups are misses and its "
                "stores are skipped, retrying with backoff up to %.0fs (logged again when "
                "it is back)", self.who, error, self.max_backoff_s)
