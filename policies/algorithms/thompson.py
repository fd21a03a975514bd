"""Discounted Thompson sampling on goodput (Gaussian rewards, unknown scale).

Discounting forgets old rounds geometrically, so after the best arm changes the stale arm's
posterior widens and the new best is found again; ``discount`` trades tracking speed for noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from policies.algorithms.base import ArmTable, Learner
from policies.context import Context
from policies.params import Param


class DiscountedThompson(Learner):
    NAME: ClassVar[str] = "discounted_thompson"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "discount": Param(0.9, "Weight kept per round by old observations (1: plain Thompson).", 0.5, 1.0),
        "noise_floor": Param(
            0.02, "Smallest reward noise assumed, as a fraction of the context's mean goodput.", 0.0, 1.0
        ),
        "prior_weight": Param(0.5, "Pseudo-rounds of the optimistic prior on unobserved arms.", 0.01, 100.0),
    }

    def _before_round(self, t: ArmTable) -> None:
        t.decay(float(self.params["discount"]))

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        t = self.table(ctx)
        idx = np.asarray(allowed)
        n, s, q = t.n[idx], t.s[idx], t.q[idx]
        seen = n > 1e-9
        if not seen.any():
            return int(idx[int(self.rng.integers(len(idx)))])
        means = np.where(seen, s / np.where(seen, n, 1.0), 0.0)
        scale = float(np.abs(means[seen]).max()) or 1.0
        resid = float(np.sum(np.where(seen, q - s * means, 0.0)))
        var = max(resid / float(n[seen].sum()), (float(self.params["noise_floor"]) * scale) ** 2, 1e-12)
        # Unobserved arms: an optimistic prior at the best mean seen, as wide as the context's scale.
        w0 = float(self.params["prior_weight"])
        mu = np.where(seen, means, float(means[seen].max()))
        sd = np.where(seen, np.sqrt(var / np.maximum(n, 1e-9)), scale / np.sqrt(w0))
        draws = self.rng.normal(mu, sd)
        return int(idx[int(np.argmax(draws))])


class Thompson(DiscountedThompson):
    """Plain Thompson sampling: the same posterior, never forgetting (discount fixed at 1)."""

    NAME: ClassVar[str] = "thompson"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        k: v for k, v in DiscountedThompson.PARAMS.items() if k != "discount"
    }

    def _before_round(self, t: ArmTable) -> None:
        return None
