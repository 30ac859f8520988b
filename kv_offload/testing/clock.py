"""FakeClock: a clock for tests (anything that takes ``clock: Callable[[], float]``) that
moves only when the test sets ``now``, so no assertion depends on how fast a host runs."""

from __future__ import annotations


class FakeClock:
    """Seconds that pass only when the test says so (``clock.now += seconds``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
