"""EXP3Spec (BanditSpec, arXiv 2505.15141, Algorithm 5): anytime EXP3 for adversarial rewards.

Importance-weighted losses ``1{i = I_t} (1 - r) / p_i`` with the scaled reward r in [0, 1] (goodput over
the context's largest round goodput so far), learning rate ``eta_t = sqrt(log K / (t K))``, arms drawn
from ``softmax(-eta_t * cumulative loss)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.algorithms.base import (
    MAX_REWARD,
    Learner,
    saved_context,
    saved_count,
    saved_mapping,
    saved_number,
    saved_numbers,
)
from policies.arms import Arm
from policies.context import Context
from policies.params import Param

#: The largest cumulative loss kept. An arm played at a probability so small that 1 / p overflowed
#: had an infinite loss, which no snapshot can hold (strict JSON): the sidecar could not save the loop
#: and started it afresh. Capped, its weight in the softmax is 0 all the same.
MAX_LOSS = 1e300


class EXP3Spec(Learner):
    NAME: ClassVar[str] = "exp3spec"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "eta_scale": Param(1.0, "Multiplies the anytime learning rate.", 0.01, 100.0),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self._loss: dict[Context, np.ndarray] = {}
        self._p: dict[Context, np.ndarray] = {}
        self._t: dict[Context, int] = {}
        self._top: dict[Context, float] = {}

    def _probs(self, ctx: Context, allowed: Sequence[int]) -> np.ndarray:
        loss = self._loss.setdefault(ctx, np.zeros(len(self.arms)))
        idx = np.asarray(allowed)
        k = len(idx)
        t = self._t.get(ctx, 0) + 1
        eta = float(self.params["eta_scale"]) * np.sqrt(np.log(max(k, 2)) / (t * k))
        z = -eta * loss[idx]
        # Every allowed arm's loss infinite: z - z.max() would be NaN throughout; draw uniformly.
        w = np.exp(z - z.max()) if np.isfinite(z.max()) else np.ones(k)
        p = np.zeros(len(self.arms))
        p[idx] = w / w.sum()
        return p

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        p = self._probs(ctx, allowed)
        self._p[ctx] = p
        return int(self.rng.choice(len(self.arms), p=p))

    def update(self, ctx: Context, rewards: Mapping[int, float]) -> None:
        super().update(ctx, rewards)
        loss = self._loss.setdefault(ctx, np.zeros(len(self.arms)))
        p = self._p.get(ctx)
        top = max(self._top.get(ctx, 0.0), *rewards.values()) if rewards else self._top.get(ctx, 0.0)
        self._top[ctx] = top
        for i, r in rewards.items():
            pi = float(p[i]) if p is not None and p[i] > 0 else 1.0
            loss[i] = min(loss[i] + (1.0 - min(max(r / top, 0.0), 1.0) if top > 0 else 1.0) / pi, MAX_LOSS)
        self._t[ctx] = self._t.get(ctx, 0) + 1

    def estimates(self, ctx: Context) -> np.ndarray:
        return self.table(ctx).means()

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "loss": {c.key: v.tolist() for c, v in self._loss.items()},
            "t": {c.key: v for c, v in self._t.items()},
            "top": {c.key: v for c, v in self._top.items()},
            # The last draw's probabilities: the next update divides the played arm's loss by its own.
            "p": {c.key: v.tolist() for c, v in self._p.items()},
        }

    def _loaded(self, state: Mapping[str, Any]) -> dict[str, Any]:
        n = len(self.arms)
        # "p" is absent from snapshots of older versions: the next update takes p = 1.
        p = saved_mapping(state.get("p", {}), "p", "a mapping of context to probabilities")
        loss = saved_mapping(state.get("loss", {}), "loss", "a mapping of context to losses")
        t = saved_mapping(state.get("t", {}), "t", "a mapping of context to rounds")
        top = saved_mapping(state.get("top", {}), "top", "a mapping of context to goodput")
        return {
            **super()._loaded(state),
            "_p": {saved_context(c, "p"): saved_numbers(v, f"p[{c!r}]", (n,), hi=1.0) for c, v in p.items()},
            # Losses are sums of (1 - a scaled reward in [0, 1]) / p: never negative; infinite in the
            # states of versions before MAX_LOSS (one played at a p so small that 1 / p overflowed).
            "_loss": {
                saved_context(c, "loss"): saved_numbers(v, f"loss[{c!r}]", (n,), infinite=True)
                for c, v in loss.items()
            },
            # A negative round count made the learning rate's square root NaN.
            "_t": {saved_context(c, "t"): saved_count(v, f"t[{c!r}]") for c, v in t.items()},
            # The largest round goodput seen, the scale of rewards: goodput is never negative.
            "_top": {
                saved_context(c, "top"): saved_number(v, f"top[{c!r}]", hi=MAX_REWARD) for c, v in top.items()
            },
        }
