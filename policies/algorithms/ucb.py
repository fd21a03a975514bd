"""UCB1 and sliding-window UCB on goodput.

Goodput is unbounded, so rewards are scaled by the context's largest mean seen: the confidence radius
is then on the same [0, 1] scale UCB1 assumes. Sliding-window UCB (Garivier & Moulines) keeps only the
last ``window`` rounds, so an arm whose goodput changed is judged on recent rounds alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.algorithms.base import Learner
from policies.arms import Arm, Method
from policies.context import Context
from policies.params import Param


def _ucb_pick(n: np.ndarray, s: np.ndarray, allowed: Sequence[int], c: float, t: float) -> int:
    for i in allowed:
        if n[i] <= 0:
            return int(i)
    idx = np.asarray(allowed)
    means = s[idx] / n[idx]
    scale = float(np.abs(means).max()) or 1.0
    bonus = c * np.sqrt(2.0 * np.log(max(t, 2.0)) / n[idx])
    return int(idx[int(np.argmax(means / scale + bonus))])


class UCB1(Learner):
    NAME: ClassVar[str] = "ucb1"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "c": Param(1.0, "Scale of the confidence bonus (1: UCB1 as published).", 0.0, 10.0),
    }

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        t = self.table(ctx)
        return _ucb_pick(t.n, t.s, allowed, float(self.params["c"]), float(t.n.sum()))


class SlidingWindowUCB(Learner):
    NAME: ClassVar[str] = "sw_ucb"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "window": Param(100, "Rounds kept per context.", 2, 100000),
        "c": Param(0.2, "Scale of the confidence bonus (rewards are scaled by the largest mean).", 0.0, 10.0),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self._hist: dict[Context, deque[tuple[int, float]]] = {}

    def update(self, ctx: Context, rewards: Mapping[int, float]) -> None:
        h = self._hist.setdefault(ctx, deque(maxlen=int(self.params["window"])))
        for i, r in rewards.items():
            h.append((i, r))
        t = self.table(ctx)
        t.n[:] = 0
        t.s[:] = 0
        t.q[:] = 0
        for i, r in h:
            t.add(i, r, 1.0)

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        t = self.table(ctx)
        return _ucb_pick(t.n, t.s, allowed, float(self.params["c"]), float(t.n.sum()))

    def on_drift(self, cls: str, method: Method, keep: float) -> None:
        """The window is the statistic: drop the drifted arms' rounds (their newest ``keep`` share stays)."""
        idx = {i for i, a in enumerate(self.arms) if a.method is method}
        for ctx, h in self._hist.items():
            if not idx or ctx.traffic_class != cls:
                continue
            rows = [(i, r) for i, r in h if i in idx]
            kept = set(range(len(rows) - int(len(rows) * keep), len(rows)))
            j = -1
            out: list[tuple[int, float]] = []
            for i, r in h:
                if i in idx:
                    j += 1
                    if j not in kept:
                        continue
                out.append((i, r))
            h.clear()
            h.extend(out)
            t = self.table(ctx)
            t.n[:] = 0
            t.s[:] = 0
            t.q[:] = 0
            for i, r in h:
                t.add(i, r, 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "hist": {c.key: list(map(list, h)) for c, h in self._hist.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        w = int(self.params["window"])
        self._hist = {
            Context.parse(c): deque(((int(i), float(r)) for i, r in h), maxlen=w)
            for c, h in state.get("hist", {}).items()
        }
