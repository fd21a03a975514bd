"""Page-Hinkley change detection on first-position draft acceptance, per (traffic class, method).

The statistic is whether a draft's first token was accepted: it does not depend on the draft length K,
so verified drafts of every K and the counterfactual scores the engine reports (n-gram on every
request-step, the EAGLE head's first position) all feed the same stream. Acceptance does not depend on
batch size, so one detector per (class, method) serves every bucket.

Two-sided Page-Hinkley (Page 1954; Hinkley 1971): with ``m`` the running mean since the last alarm,
``up += x - m - delta`` and ``down += x - m + delta``; an alarm fires when ``up`` rises ``threshold``
above its minimum (acceptance rose) or ``down`` falls ``threshold`` below its maximum (it fell). Each
request-step row is one sample, summed per step, so a step of batch 32 weighs 32 samples. Saved
tests are checked on load against what ``add`` keeps, and refused with a ValueError naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.algorithms.base import MAX_COUNT, saved_class, saved_count, saved_mapping, saved_numbers
from policies.arms import Method
from policies.params import Param, shown

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
#: Rounding a running mean of values in [0, 1] may leave it this far outside.
_SLACK = 1e-9


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

    def load(self, v: Any, where: str) -> None:
        """Load what ``to_json`` saved, checked first against what ``add`` keeps (ValueError naming
        ``where``): ``float()`` took "nan" (a test of NaN sums never fires again) and a negative count."""
        saved = saved_numbers(v, where, (6,), lo=-math.inf).tolist()
        n, mean, up, up_min, down, down_max = saved
        if not (0 <= n <= MAX_COUNT and n == math.floor(n)):
            raise ValueError(f"{where}: a sample count is a whole number in [0, {MAX_COUNT}], got {shown(n)}")
        if not -_SLACK <= mean <= 1 + _SLACK:  # a running mean of values in [0, 1]
            raise ValueError(
                f"{where}: the mean of first-position acceptances is in [0, 1], got {shown(mean)}"
            )
        if up_min > min(0.0, up) or down_max < max(0.0, down):
            raise ValueError(f"{where}: the running minimum and maximum do not bound the sums")
        self.n, self.mean, self.up, self.up_min, self.down, self.down_max = saved


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
        """Load what ``state_dict`` saved; every field is checked before any is taken (ValueError naming
        it: ``int()`` took "7", true and -1 as a count of alarms)."""
        alarms = saved_count(state.get("alarms", 0), "alarms")
        tests = {}
        saved = saved_mapping(
            state.get("tests", {}), "tests", "a mapping of 'CLASS|METHOD' to a Page-Hinkley test"
        )
        for key, v in saved.items():
            where = f"tests[{key!r}]"
            c, _, m = key.rpartition("|")
            saved_class(c, where)
            if m not in set(Method):
                raise ValueError(f"{where}: {m!r} is not a drafting method (one of {', '.join(Method)})")
            t = tests[(c, m)] = PageHinkley(self.delta, self.threshold, self.min_samples)
            t.load(v, where)
        self.alarms, self.tests = alarms, tests
