"""Rate limits on input paths: a token bucket per thing limited (an engine's steps and request-steps,
admin changes).

Pure and clock-injected, so tests drive it with a fake clock. What must hold: a refused take spends
nothing, so a flood refused costs the limited party nothing it could have used later.
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

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def can_take(self, n: float = 1.0) -> bool:
        """Whether ``take(n)`` would succeed now (spends nothing)."""
        self._refill()
        return n <= self._tokens

    def take(self, n: float = 1.0) -> bool:
        self._refill()
        if n > self._tokens:
            return False
        self._tokens -= n
        return True


class ReportLimit:
    """An engine's report budget: steps and request-steps (a step's requests, summed over the steps)
    per second, a ``TokenBucket`` each. Both count: steps bound the batches' per-step work, and
    request-steps the per-request work, which a step of thousands of requests multiplies."""

    __slots__ = ("request_steps", "steps")

    def __init__(self, *, steps: TokenBucket, request_steps: TokenBucket) -> None:
        self.steps, self.request_steps = steps, request_steps

    def take(self, steps: int, request_steps: int) -> str:
        """Spend a batch's ``steps`` and ``request_steps``: "" when both are within their budgets,
        else the first exceeded ("steps", "request_steps"), and nothing is spent from either."""
        if not self.steps.can_take(steps):
            return "steps"
        if not self.request_steps.can_take(request_steps):
            return "request_steps"
        self.steps.take(steps)
        self.request_steps.take(request_steps)
        return ""
