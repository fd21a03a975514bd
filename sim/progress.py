"""A plain-text progress bar on stderr for long runs (no dependency, rate-limited, no ANSI codes)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``advance(n)`` as work completes; redraws at most every ``interval_s`` with a carriage return."""

    def __init__(
        self,
        *,
        total: int,
        label: str = "",
        stream: TextIO | None = None,
        enabled: bool | None = None,
        interval_s: float = 0.5,
        width: int = 30,
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.interval_s = interval_s
        self.width = width
        self.done = 0
        self._last = -float("inf")
        self._started = time.monotonic()

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + int(n))
        self._draw()

    def line(self) -> str:
        frac = self.done / self.total
        fill = round(frac * self.width)
        elapsed = time.monotonic() - self._started
        return f"[{'#' * fill}{'.' * (self.width - fill)}] {frac * 100:5.1f}% {elapsed:6.1f}s {self.label}"

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval_s and self.done < self.total:
            return
        self._last = now
        self.stream.write("\r" + self.line()[:120].ljust(120))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
