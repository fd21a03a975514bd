"""Page-Hinkley change detection on first-position draft acceptance, per (traffic class, method).

The statistic is whether a draft's first token was accepted: it does not depend on the draft length K,
so verified drafts of every K and the counterfactual scores the engine reports (n-gram on every
request-step, the EAGLE head's first position) all feed the same stream. Acceptance does not depend on
batch size, so one detector per (class, method) serves every bucket.

Two-sided Page-Hinkley (Page 1954; Hinkley 1971): with ``m`` the running mean since the last alarm,
``up += x - m - delta`` and ``down += x - m + delta``; an alarm fires when ``up`` rises ``threshold``
above its minimum (acceptance rose) or ``down`` falls ``threshold`` below its maximum (it fell). Each
request-step row is one sample, summed per step, so a step of batch 32 weighs 32 samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.params import Param

#: Spec fields of ``spec.drift``.
DRIFT_FIELDS: dict[str, Param] = {
    "detector": Param("none", "page_hinkley to detect changes in acceptance, none to disable."),
    "delta": Param(0.05, "Tolerated drift of first-position acceptance (magnitude allowance).", 0.0, 1.0),
    "threshold": Param(
        30.0, "Page-Hinkley alarm threshold in summed samples (higher: fewer alarms).", 0.1, 1e6
    ),
    "min_samples": Param(50, "Samples after an alarm before the next alarm may fire.", 1, 10**7),
    "shrink": Param(0.1, "Weight kept by the affected statistics on an alarm (0: forget them).", 0.0, 1.0),
}
DETECTORS = ("none", "page_hinkley")


@dataclass(slots=True)
class PageHinkley:
    """One two-sided Page-Hinkley test on a stream of values in [0, 1]."""

    delta: float
    threshold: float
    min_samples: int
    n: float = 0.0
    mean: float = 0.0
    up: float = 0.0
    up_min: float = 0.0
    down: float = 0.0
    down_max: float = 0.0

    def add(self, total: float, count: int) -> bool:
        """Add ``count`` samples summing to ``total``; True when a change is detected (then restarts)."""
        if count <= 0:
            return False
        self.n += count
        self.mean += (total - count * self.mean) / self.n
        self.up += total - count * (self.mean + self.delta)
        self.down += total - count * (self.mean - self.delta)
        self.up_min = min(self.up_min, self.up)
        self.down_max = max(self.down_max, self.down)
        if self.n < self.min_samples:
            return False
        if self.up - self.up_min > self.threshold or self.down_max - self.down > self.threshold:
            self.reset()
            return True
        return False

    def reset(self) -> None:
        self.n = self.mean = self.up = self.up_min = self.down = self.down_max = 0.0

    def to_json(self) -> list[float]:
        return [self.n, self.mean, self.up, self.up_min, self.down, self.down_max]

    def load(self, v: list[float]) -> None:
        self.n, self.mean, self.up, self.up_min, self.down, self.down_max = (float(x) for x in v)


@dataclass(slots=True)
class DriftMonitor:
    """A Page-Hinkley test per (class, method) key; ``feed`` returns the keys that changed."""

    delta: float
    threshold: float
    min_samples: int
    tests: dict[tuple[str, str], PageHinkley] = field(default_factory=dict)
    alarms: int = 0

    @classmethod
    def from_params(cls, p: Mapping[str, Any]) -> DriftMonitor:
        return cls(float(p["delta"]), float(p["threshold"]), int(p["min_samples"]))

    def feed(self, key: tuple[str, str], first_accepted: np.ndarray) -> bool:
        """``first_accepted``: one 0/1 value per row (first draft position accepted)."""
        t = self.tests.get(key)
        if t is None:
            t = self.tests[key] = PageHinkley(self.delta, self.threshold, self.min_samples)
        fired = t.add(float(first_accepted.sum()), len(first_accepted))
        self.alarms += fired
        return fired

    def state_dict(self) -> dict[str, Any]:
        return {"alarms": self.alarms, "tests": {f"{c}|{m}": t.to_json() for (c, m), t in self.tests.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.alarms = int(state.get("alarms", 0))
        self.tests = {}
        for key, v in state.get("tests", {}).items():
            c, _, m = str(key).rpartition("|")
            t = PageHinkley(self.delta, self.threshold, self.min_samples)
            t.load(list(v))
            self.tests[(c, m)] = t
