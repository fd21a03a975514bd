"""Rate limits on input paths: a token bucket per thing limited (an engine's steps, admin changes).

Pure and clock-injected, so tests drive it with a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; ``take(n)`` spends n or nothing."""

    __slots__ = ("_at", "_tokens", "burst", "clock", "rate")

    def __init__(self, *, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate and burst must be > 0, got {rate}, {burst}")
        self.rate, self.burst, self.clock = rate, burst, clock
        self._tokens = burst
        self._at = clock()

    def take(self, n: float = 1.0) -> bool:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if n > self._tokens:
            return False
        self._tokens -= n
        return True
