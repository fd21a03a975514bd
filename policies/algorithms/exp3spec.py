"""EXP3Spec (BanditSpec, arXiv 2505.15141, Algorithm 5): anytime EXP3 for adversarial rewards.

Importance-weighted losses ``1{i = I_t} (1 - r) / p_i`` with the scaled reward r in [0, 1], learning rate
``eta_t = sqrt(log K / (t K))``, arms drawn from ``softmax(-eta_t * cumulative loss)``.

The scale: r is a round's goodput over the largest goodput of the context's last ``SCALE_ROUNDS`` rounds
(with rewards), this one included, so r is in [0, 1] and the round's best arm scores 1. The scale must
forget: it was the largest round goodput the context had ever seen, and one outlier (a step reported
with a tiny but valid duration, a traffic phase much faster than the rest) made every later scaled
reward ~0, every arm's loss ~1 / p, and the learner never told the arms apart again. Now an outlier
leaves the scale after ``SCALE_ROUNDS`` rounds, however large it was.

Saved state: ``tops`` holds those goodputs per context, oldest first (at most ``SCALE_ROUNDS``, each in
[0, MAX_REWARD]); ``top`` their largest, the scale that versions before the window read (so they can
load a snapshot of this one). A snapshot of those versions has only ``top``: its context's window
starts with that one value.
"""

from __future__ import annotations

from collections import deque
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
#: Rounds (with rewards) of a context whose largest goodput scales its rewards. EXP3 sees one arm a
#: round: the window must hold rounds of every arm the draw explores, or the one played would score
#: 1 whatever it earned (at 1 no arm is ever told apart); at 100 an outlier is gone within 100 rounds.
SCALE_ROUNDS = 100


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
        # Per context, the largest goodput of each of its last SCALE_ROUNDS rounds with rewards.
        self._tops: dict[Context, deque[float]] = {}

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
        ring = self._tops.get(ctx)
        if rewards:
            if ring is None:
                ring = self._tops[ctx] = deque(maxlen=SCALE_ROUNDS)
            ring.append(max(0.0, *rewards.values()))
        top = max(ring, default=0.0) if ring is not None else 0.0
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
            "tops": {c.key: list(v) for c, v in self._tops.items()},
            # The scale, for versions before the window (they read "top" and ignore "tops").
            "top": {c.key: max(v, default=0.0) for c, v in self._tops.items()},
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
        # "tops" is absent from snapshots of versions before the window: their "top" starts it.
        tops = saved_mapping(state.get("tops", {}), "tops", "a mapping of context to goodputs")
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
            "_tops": _saved_windows(top, tops),
        }


def _saved_windows(top: Mapping[str, Any], tops: Mapping[str, Any]) -> dict[Context, deque[float]]:
    """The scale windows a snapshot's ``top`` and ``tops`` restore; ValueError naming the field. Goodput
    is never negative. A context in ``top`` only (a snapshot of a version before the window) starts its
    window with that value; where ``tops`` holds the context, its ``top`` (their largest, as this
    version saves it) is checked but not read."""
    out = {
        saved_context(c, "top"): deque([saved_number(v, f"top[{c!r}]", hi=MAX_REWARD)], maxlen=SCALE_ROUNDS)
        for c, v in top.items()
    }
    for c, v in tops.items():
        where = f"tops[{c!r}]"
        ctx = saved_context(c, "tops")
        window = saved_numbers(v, where, (None,), hi=MAX_REWARD)
        # Longer than any version saves: taking its last SCALE_ROUNDS would drop what it meant silently.
        if len(window) > SCALE_ROUNDS:
            raise ValueError(f"{where}: at most {SCALE_ROUNDS} rounds' goodputs expected, got {len(window)}")
        out[ctx] = deque(window.tolist(), maxlen=SCALE_ROUNDS)
    return out
