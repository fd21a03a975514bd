"""Slow-loop learners, by name. Each family lives in its own module."""

from __future__ import annotations

from policies.algorithms.base import Learner
from policies.algorithms.epsilon_greedy import EpsilonGreedy
from policies.algorithms.goodput_model import GoodputModel
from policies.algorithms.static import Static
from policies.algorithms.thompson import DiscountedThompson

REGISTRY: dict[str, type[Learner]] = {
    c.NAME: c for c in (Static, EpsilonGreedy, DiscountedThompson, GoodputModel)
}

__all__ = ["REGISTRY", "DiscountedThompson", "EpsilonGreedy", "GoodputModel", "Learner", "Static"]
