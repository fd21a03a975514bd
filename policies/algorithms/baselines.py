"""What users run today, as learners, so every policy is measured against them on the same path.

* ``batch_schedule``: vLLM's ``num_speculative_tokens_per_batch_size``, a fixed batch-size -> K table
  (vLLM's EAGLE-3 example: ``1-16:5,17-32:4,33-64:3,65-128:1,129+:0``). No learning.
* ``speculation_gate``: TensorRT-LLM's ``SpeculationGate``: a rolling window of per-step acceptance
  rates; once the window is full and its mean is below ``threshold``, speculation is off for good.
* ``ngram_fallback``: EAGLE-3 until its rolling acceptance rate in a traffic class falls below
  ``threshold``, then n-gram for that class from then on.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.algorithms.base import (
    Learner,
    StepwiseLearner,
    saved_class,
    saved_flag,
    saved_mapping,
    saved_numbers,
)
from policies.arms import METHOD_CODES, OFF, Arm, Method
from policies.context import ANY_CLASS, Context
from policies.observation import StepObservation
from policies.params import Param


def _nearest(arms: Sequence[Arm], want: Arm, allowed: Sequence[int]) -> int:
    for i in allowed:
        if arms[i] == want:
            return int(i)
    same = [i for i in allowed if arms[i].method == want.method]
    if same:
        return int(min(same, key=lambda i: abs(arms[i].k - want.k)))
    off = [i for i in allowed if arms[i] == OFF]
    return int(off[0] if off else allowed[0])


#: A schedule entry's batch range: ``LO-HI``, ``N`` (``N-N``) or ``LO+`` (unbounded), ASCII digits only.
_RANGE = re.compile(r"(?P<lo>[0-9]+)\s*(?:-\s*(?P<hi>[0-9]+)|(?P<plus>\+))?")


def parse_schedule(text: str) -> list[tuple[int, int, int]]:
    """``"1-16:5,17-32:4,129+:0"`` -> [(1, 16, 5), (17, 32, 4), (129, 0, 0)] (0: unbounded)."""
    out: list[tuple[int, int, int]] = []
    for part in text.split(","):
        entry = part.strip()
        rng, sep, k = entry.partition(":")
        if not sep:
            raise ValueError(f"schedule entry {entry!r}: expected 'LO-HI:K' or 'LO+:K'")
        # Digits only on each side of '-': 0 is the unbounded sentinel inside the table, so a written
        # HI of 0 ('1-0:5') or an empty one ('5-:3') must not slip through as 'LO+' or 'LO-LO'.
        m = _RANGE.fullmatch(rng.strip())
        try:
            if m is None:
                raise ValueError
            lo = int(m["lo"])
            hi = 0 if m["plus"] else int(m["hi"] or lo)
            kv = int(k)
        except ValueError:
            raise ValueError(
                f"schedule entry {entry!r}: expected integers, as 'LO-HI:K', 'N:K' or 'LO+:K'"
            ) from None
        if lo < 1 or (not m["plus"] and hi < lo) or kv < 0:
            raise ValueError(f"schedule entry {entry!r}: need 1 <= LO <= HI and K >= 0")
        out.append((lo, hi, kv))
    return out


def bucket_batch(label: str) -> int:
    """The batch size a bucket label stands for (its upper bound; the lower one for the open bucket)."""
    if label.endswith("+"):
        return int(label[:-1])
    return int(label.rpartition("-")[2])


class BatchSchedule(Learner):
    NAME: ClassVar[str] = "batch_schedule"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "method": Param("eagle3", "The drafting method (one per engine in vLLM)."),
        "schedule": Param("1-16:5,17-32:4,33-64:3,65-128:1,129+:0", "Batch-size ranges and their K."),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self.table_ = parse_schedule(str(self.params["schedule"]))
        self.method = Method(str(self.params["method"]))

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        b = bucket_batch(ctx.bucket)
        k = next((kk for lo, hi, kk in self.table_ if b >= lo and (hi == 0 or b <= hi)), 0)
        return _nearest(self.arms, Arm(self.method, k) if k > 0 else OFF, allowed)


class SpeculationGate(StepwiseLearner):
    NAME: ClassVar[str] = "speculation_gate"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "arm": Param("eagle3:3", "The arm played until the gate closes."),
        "window": Param(64, "Steps in the rolling window of acceptance rates.", 1, 1_000_000),
        "threshold": Param(0.3, "Mean acceptance rate below which speculation stops for good.", 0.0, 1.0),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self.arm = Arm.parse(str(self.params["arm"]))
        self._rates: deque[float] = deque(maxlen=int(self.params["window"]))
        self.closed = False

    def _observe_step(self, obs: StepObservation, bucket: str, per_class: bool) -> None:
        drafted = int(obs.drafted.sum())
        if self.closed or drafted <= 0:
            return
        self._rates.append(int(obs.accepted.sum()) / drafted)
        if len(self._rates) == self._rates.maxlen and float(np.mean(self._rates)) < float(
            self.params["threshold"]
        ):
            self.closed = True

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        return _nearest(self.arms, OFF if self.closed else self.arm, allowed)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "closed": self.closed, "rates": list(self._rates)}

    def _loaded(self, state: Mapping[str, Any]) -> dict[str, Any]:
        rates = saved_numbers(state.get("rates", []), "rates", (None,), hi=1.0)
        return {
            **super()._loaded(state),
            # bool() took any string, "false" too, as a gate closed for good.
            "closed": saved_flag(state.get("closed", False), "closed"),
            # The saved window replaces this one (extending it mixed in what this learner had seen itself).
            "_rates": deque(rates.tolist(), maxlen=int(self.params["window"])),
        }


class NgramFallback(StepwiseLearner):
    NAME: ClassVar[str] = "ngram_fallback"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "k": Param(3, "Draft length of both methods.", 1, 64),
        "window": Param(64, "EAGLE-3 steps in the rolling acceptance window.", 1, 1_000_000),
        "threshold": Param(
            0.5, "EAGLE-3 acceptance rate below which a class falls back to n-gram.", 0.0, 1.0
        ),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self._rates: dict[str, deque[float]] = {}
        self.fell_back: set[str] = set()

    def _observe_step(self, obs: StepObservation, bucket: str, per_class: bool) -> None:
        eagle = (obs.method == METHOD_CODES[Method.EAGLE3]) & (obs.drafted > 0)
        if not eagle.any():
            return
        classes = np.asarray(obs.traffic_class)
        for c in (ANY_CLASS, *(sorted(set(obs.traffic_class)) if per_class else ())):
            rows = eagle if c == ANY_CLASS else eagle & (classes == c)
            if c in self.fell_back or not rows.any():
                continue
            w = self._rates.setdefault(c, deque(maxlen=int(self.params["window"])))
            w.append(float(obs.accepted[rows].sum() / obs.drafted[rows].sum()))
            if len(w) == w.maxlen and float(np.mean(w)) < float(self.params["threshold"]):
                self.fell_back.add(c)

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        cls = ctx.traffic_class
        method = Method.NGRAM if cls in self.fell_back else Method.EAGLE3
        return _nearest(self.arms, Arm(method, int(self.params["k"])), allowed)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "fell_back": sorted(self.fell_back),
            # The rolling windows too: a class one step from falling back must not start a new window.
            "rates": {c: list(w) for c, w in self._rates.items()},
        }

    def _loaded(self, state: Mapping[str, Any]) -> dict[str, Any]:
        # "rates" is absent from snapshots of older versions: empty windows.
        saved = saved_mapping(state.get("rates", {}), "rates", "a mapping of traffic class to rates")
        w = int(self.params["window"])
        rates = {
            saved_class(c, "rates"): deque(
                saved_numbers(v, f"rates[{c!r}]", (None,), hi=1.0).tolist(), maxlen=w
            )
            for c, v in saved.items()
        }
        fell_back = state.get("fell_back", [])
        # set() of a string is its letters; of a list of lists, a TypeError.
        if not isinstance(fell_back, list | tuple):
            raise ValueError(f"fell_back: a list of traffic classes expected, got {type(fell_back).__name__}")
        classes = {saved_class(c, f"fell_back[{j}]") for j, c in enumerate(fell_back)}
        return {**super()._loaded(state), "fell_back": classes, "_rates": rates}
