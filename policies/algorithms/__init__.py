"""Slow-loop learners, by name. Each family lives in its own module."""

from __future__ import annotations

from policies.algorithms.base import Learner
from policies.algorithms.baselines import BatchSchedule, NgramFallback, SpeculationGate
from policies.algorithms.epsilon_greedy import EpsilonGreedy
from policies.algorithms.exp3spec import EXP3Spec
from policies.algorithms.goodput_model import GoodputModel
from policies.algorithms.hedge import Hedge
from policies.algorithms.static import Static
from policies.algorithms.thompson import DiscountedThompson, Thompson
from policies.algorithms.ucb import UCB1, SlidingWindowUCB
from policies.algorithms.ucbspec import UCBSpec

REGISTRY: dict[str, type[Learner]] = {
    c.NAME: c
    for c in (
        Static,
        BatchSchedule,
        SpeculationGate,
        NgramFallback,
        EpsilonGreedy,
        UCB1,
        SlidingWindowUCB,
        UCBSpec,
        EXP3Spec,
        Thompson,
        DiscountedThompson,
        Hedge,
        GoodputModel,
    )
}

__all__ = [
    "REGISTRY",
    "UCB1",
    "BatchSchedule",
    "DiscountedThompson",
    "EXP3Spec",
    "EpsilonGreedy",
    "GoodputModel",
    "Hedge",
    "Learner",
    "NgramFallback",
    "SlidingWindowUCB",
    "SpeculationGate",
    "Static",
    "Thompson",
    "UCBSpec",
]
