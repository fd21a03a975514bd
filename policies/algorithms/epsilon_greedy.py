"""Epsilon-greedy on goodput: the simplest learner that keeps exploring."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from policies.algorithms.base import ArmTable, Learner, greedy
from policies.context import Context
from policies.params import Param


class EpsilonGreedy(Learner):
    NAME: ClassVar[str] = "epsilon_greedy"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "epsilon": Param(0.1, "Probability of playing a uniformly random arm in a round.", 0.0, 1.0),
        "discount": Param(1.0, "Weight kept per round by old observations (1: never forget).", 0.5, 1.0),
    }

    def _before_round(self, t: ArmTable) -> None:
        t.decay(float(self.params["discount"]))

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        if self.rng.random() < float(self.params["epsilon"]):
            return int(allowed[int(self.rng.integers(len(allowed)))])
        return greedy(self.table(ctx).means(), allowed)
