"""Safety guards on the slow loop's choices: a p99 TPOT guard, an exploration budget, hysteresis.

Each guard is a small stateful filter the ControlLoop applies after the learner has picked an arm:

* ``TpotGuard``: per batch bucket, the p99 of recent per-request TPOT (step time over the tokens the
  request got from the step) against the policy's SLO. Above it, the bucket is capped to arms with a
  shorter draft than it plays now (shorter verify steps; ``off`` last); the cap tightens while the p99
  stays above and lifts once it is back under ``release`` x SLO.
* ``ExplorationBudget``: at high load a wasted exploratory round costs every request in a large batch,
  so there the share of decisions that depart from the learner's greedy choice is capped.
* ``keeps_current``: hysteresis on estimated goodput, so two arms within the margin do not flip-flop:
  the policy's relative ``switch_margin`` and the learner's own margin from its uncertainty.

Saved guard state (snapshots, the fleet's posteriors) is checked field by field on load, as the
learners' is, and refused with a ValueError naming the field: never coerced into range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.algorithms.base import (
    MAX_COUNT,
    saved_bucket,
    saved_context,
    saved_count,
    saved_mapping,
    saved_numbers,
)
from policies.arms import MAX_K, Arm
from policies.context import Context
from policies.params import Param, shown

SLO_FIELDS: dict[str, Param] = {
    "p99_tpot_ms": Param(
        0.0, "p99 time per output token the guard keeps each bucket under (0: off).", 0.0, 1e6
    ),
    "window": Param(512, "Recent request-steps per bucket the p99 is taken over.", 16, 10**6),
    "min_samples": Param(64, "Request-steps needed (after a change of cap) before the guard acts.", 1, 10**6),
    "release": Param(0.9, "The cap lifts once the p99 is below this share of the SLO.", 0.1, 1.0),
}
EXPLORATION_FIELDS: dict[str, Param] = {
    "max_share_at_high_load": Param(
        1.0, "Largest share of decisions that may explore, in buckets at high load (1: no limit).", 0.0, 1.0
    ),
    "high_load_batch": Param(32, "Buckets holding this batch size or larger count as high load.", 1, 10**6),
}


def keeps_current(
    estimates: np.ndarray,
    current: int,
    new: int,
    margin: float,
    *,
    learnt: tuple[float, float] | None = None,
) -> bool:
    """True when ``new`` does not beat ``current`` by the relative ``margin`` on estimated goodput, or
    when the learner's ``learnt`` (predicted gain, margin from its uncertainty) says the gain is not
    above the margin.

    An unestimated arm (NaN) is never held back: it has to be tried before it can be judged.
    """
    if current < 0 or new == current:
        return False
    cur, nxt = float(estimates[current]), float(estimates[new])
    if not (np.isfinite(cur) and np.isfinite(nxt)):
        return False
    if learnt is not None and np.isfinite(learnt).all() and learnt[0] <= learnt[1]:
        return True
    if margin <= 0:
        return False
    return nxt < cur * (1.0 + margin) if cur > 0 else nxt <= cur


def greedy_choice(estimates: np.ndarray, allowed: Sequence[int]) -> int | None:
    """The allowed arm with the best finite estimate (None when none is estimated)."""
    seen = [i for i in allowed if np.isfinite(estimates[i])]
    return max(seen, key=lambda i: float(estimates[i])) if seen else None


@dataclass(slots=True)
class _Window:
    values: np.ndarray
    pos: int = 0
    count: int = 0
    #: Arms with K >= cap are excluded; None: no cap.
    cap: int | None = None

    def add(self, v: np.ndarray) -> None:
        size = len(self.values)
        v = v[-size:]
        idx = (self.pos + np.arange(len(v))) % size
        self.values[idx] = v
        self.pos = int((self.pos + len(v)) % size)
        self.count = min(self.count + len(v), size)

    def clear(self) -> None:
        self.pos = self.count = 0

    def recent(self) -> np.ndarray:
        """The values held, oldest first (``add`` of them to an empty window restores what the p99 and
        later additions see)."""
        if self.count < len(self.values):
            return self.values[: self.count]
        return np.roll(self.values, -self.pos)


@dataclass(slots=True)
class TpotGuard:
    slo_ms: float
    window: int
    min_samples: int
    release: float
    buckets: dict[str, _Window] = field(default_factory=dict)
    trips: int = 0

    @classmethod
    def from_params(cls, p: Mapping[str, Any]) -> TpotGuard:
        # At most `window` samples are kept: a saved policy from before min_samples <= window was
        # required (parse_policy(saved=True)) acts once its window is full rather than never.
        window = int(p["window"])
        return cls(float(p["p99_tpot_ms"]), window, min(int(p["min_samples"]), window), float(p["release"]))

    @property
    def enabled(self) -> bool:
        return self.slo_ms > 0

    def _win(self, bucket: str) -> _Window:
        w = self.buckets.get(bucket)
        if w is None:
            w = self.buckets[bucket] = _Window(np.zeros(self.window))
        return w

    def observe(self, bucket: str, duration_s: float, accepted: np.ndarray) -> None:
        """One step's rows in ``bucket``: each request waited the step for ``accepted + 1`` tokens."""
        if self.enabled and len(accepted):
            self._win(bucket).add(duration_s * 1e3 / (accepted.astype(np.float64) + 1.0))

    def p99(self, bucket: str) -> float | None:
        w = self.buckets.get(bucket)
        if w is None or w.count == 0:
            return None
        return float(np.percentile(w.values[: w.count], 99))

    def update(self, bucket: str, playing_k: int) -> int | None:
        """Re-evaluate ``bucket`` (its contexts now play drafts up to ``playing_k``); returns the cap."""
        if not self.enabled:
            return None
        w = self._win(bucket)
        if w.count < self.min_samples:
            return w.cap
        p = float(np.percentile(w.values[: w.count], 99))
        if p > self.slo_ms:
            cap = max(playing_k, 1)  # cap 1 leaves only `off`: nothing shorter exists
            if w.cap is None or cap < w.cap:
                self.trips += 1
            w.cap = cap if w.cap is None else min(w.cap, cap)
            w.clear()  # judge the capped arms on their own steps
        elif w.cap is not None and p <= self.release * self.slo_ms:
            w.cap = None
        return w.cap

    def cap(self, bucket: str) -> int | None:
        w = self.buckets.get(bucket)
        return w.cap if w is not None else None

    @staticmethod
    def restrict(arms: Sequence[Arm], allowed: Sequence[int], cap: int | None) -> list[int]:
        """``allowed`` without arms drafting ``cap`` tokens or more (the shortest ones if none is left)."""
        if cap is None:
            return list(allowed)
        out = [i for i in allowed if arms[i].k < cap]
        if out:
            return out
        shortest = min(arms[i].k for i in allowed)
        return [i for i in allowed if arms[i].k == shortest]

    def state_dict(self) -> dict[str, Any]:
        return {
            "trips": self.trips,
            "caps": {b: w.cap for b, w in self.buckets.items() if w.cap is not None},
            # The recent TPOTs the p99 is taken over, oldest first.
            "windows": {b: w.recent().tolist() for b, w in self.buckets.items() if w.count},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what ``state_dict`` saved (``windows`` is absent from older snapshots: they start empty)."""
        windows = {
            saved_bucket(b, "windows"): saved_numbers(v, f"windows[{b!r}]", (None,))
            for b, v in saved_mapping(
                state.get("windows", {}), "windows", "a mapping of bucket to TPOTs"
            ).items()
        }
        # Checked like the windows (``int()`` took "7", 2.5 and -7): the trips go on into the loop's
        # totals, where one out of range had the next snapshot's restore drop the whole engine.
        trips = saved_count(state.get("trips", 0), "trips")
        caps = {
            saved_bucket(b, "caps"): _saved_cap(cap, f"caps[{b!r}]")
            for b, cap in saved_mapping(state.get("caps", {}), "caps", "a mapping of bucket to K cap").items()
        }
        self.trips = trips
        self.buckets = {}
        for b, cap in caps.items():
            self._win(b).cap = cap
        for b, v in windows.items():
            self._win(b).add(v)  # the newest ``window`` of them, should the window have shrunk


@dataclass(slots=True)
class ExplorationBudget:
    max_share: float
    high_load_batch: int
    #: Per context: decisions taken, and how many of them explored.
    counts: dict[Context, list[int]] = field(default_factory=dict)

    @classmethod
    def from_params(cls, p: Mapping[str, Any]) -> ExplorationBudget:
        return cls(float(p["max_share_at_high_load"]), int(p["high_load_batch"]))

    def applies(self, bucket_range: tuple[int, int]) -> bool:
        """Whether a bucket (inclusive range; upper 0 = open) holds high-load batch sizes."""
        if self.max_share >= 1.0:
            return False
        _, hi = bucket_range
        return hi == 0 or hi >= self.high_load_batch

    def permit(self, ctx: Context, exploratory: bool) -> bool:
        """Count one decision in ``ctx``; False when an exploratory one would exceed the budget."""
        c = self.counts.setdefault(ctx, [0, 0])
        c[0] += 1
        if not exploratory:
            return True
        if c[1] + 1 <= self.max_share * c[0]:
            c[1] += 1
            return True
        return False

    def explored(self, ctx: Context) -> tuple[int, int]:
        """(exploratory decisions, all decisions) in ``ctx``."""
        c = self.counts.get(ctx, [0, 0])
        return c[1], c[0]

    def state_dict(self) -> dict[str, Any]:
        return {"counts": {k.key: list(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what ``state_dict`` saved; ValueError naming the field for counts ``permit`` never keeps
        (``int()`` took strings, fractions and a negative count of explored decisions: that one let the
        budget explore without limit at high load)."""
        counts = {}
        saved = saved_mapping(
            state.get("counts", {}), "counts", "a mapping of context to [decisions, explored]"
        )
        for k, v in saved.items():
            where = f"counts[{k!r}]"
            ctx = saved_context(k, "counts")
            pair = saved_numbers(v, where, (2,), hi=MAX_COUNT)
            if (pair != np.floor(pair)).any():
                raise ValueError(f"{where}: decisions are counted in whole numbers, got {pair.tolist()}")
            decisions, explored = (int(x) for x in pair)
            if explored > decisions:
                raise ValueError(f"{where}: explored {explored} of {decisions} decisions")
            counts[ctx] = [decisions, explored]
        self.counts = counts


def _saved_cap(value: Any, where: str) -> int:
    """A saved TPOT cap: what ``TpotGuard.update`` sets, an integer in [1, MAX_K]; ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_K:
        raise ValueError(f"{where}: expected an integer in [1, {MAX_K}], got {shown(value)}")
    return value
