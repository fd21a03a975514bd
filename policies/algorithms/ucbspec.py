"""UCBSpec (BanditSpec, arXiv 2505.15141, Algorithm 4).

Round-robin over the arms first, then the arm with the largest mean plus the radius
``L * sqrt((1 + n) / n^2 * (1 + 2 log(K t^2 sqrt(1 + n) / delta)))``. The paper's reward is the accepted
length in [1, L + 1] (its serving experiment uses throughput); here it is goodput scaled by the
context's largest mean, so ``L`` is the reward range (1) unless set otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from policies.algorithms.base import Learner
from policies.context import Context
from policies.params import Param


class UCBSpec(Learner):
    NAME: ClassVar[str] = "ucbspec"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "delta": Param(0.1, "Confidence level of the radius.", 1e-9, 1.0),
        "range": Param(1.0, "L: the range of the scaled reward (the radius scale).", 0.01, 100.0),
    }

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        t = self.table(ctx)
        for i in allowed:
            if t.n[i] <= 0:
                return int(i)
        idx = np.asarray(allowed)
        n = t.n[idx]
        means = t.s[idx] / n
        scale = float(np.abs(means).max()) or 1.0
        k, rounds = len(idx), float(t.n.sum())
        log_term = np.log(k * rounds**2 * np.sqrt(1.0 + n) / float(self.params["delta"]))
        cr = float(self.params["range"]) * np.sqrt((1.0 + n) / n**2 * (1.0 + 2.0 * log_term))
        return int(idx[int(np.argmax(means / scale + cr))])
