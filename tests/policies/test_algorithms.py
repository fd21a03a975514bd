"""Seeded behaviour of the slow-loop learners on synthetic two-arm problems."""

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from policies.algorithms import REGISTRY, DiscountedThompson, EpsilonGreedy, Learner, Static
from policies.arms import Arm

ARMS = (Arm.parse("eagle3:3"), Arm.parse("ngram:4"))
#: Goodput of the two arms (tok/s) before and after the flip; noise sd 50.
BEFORE, AFTER, NOISE = (1000.0, 800.0), (800.0, 1000.0), 50.0
#: Rounds (decisions) within which discounted Thompson sampling settles on the new best arm after a flip:
#: "settled" = the next 10 picks are all the new best. Seen here: at most 32 over 30 seeds, mean 10.
FLIP_BOUND = 40


def learner(cls: type[Learner], seed: int, **params: Any) -> Learner:
    full: Mapping[str, Any] = {k: p.default for k, p in cls.PARAMS.items()} | params
    return cls(arms=ARMS, params=full, rng=np.random.default_rng(seed))


def play(lr: Learner, seed: int, rounds: int, flip_at: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed + 10_000)
    picks = np.empty(rounds, dtype=int)
    for r in range(rounds):
        means = AFTER if flip_at is not None and r >= flip_at else BEFORE
        i = lr.select("ctx", [0, 1])
        picks[r] = i
        lr.update("ctx", {i: float(rng.normal(means[i], NOISE))})
    return picks


@pytest.mark.parametrize("cls", [DiscountedThompson, EpsilonGreedy])
@pytest.mark.parametrize("seed", range(5))
def test_stationary_two_arms_picks_the_better_arm(cls: type[Learner], seed: int) -> None:
    picks = play(learner(cls, seed), seed, 200)
    assert (picks[100:] == 0).mean() >= 0.85


@pytest.mark.parametrize("seed", range(20))
def test_discounted_thompson_recovers_after_flip_within_bound(seed: int) -> None:
    picks = play(learner(DiscountedThompson, seed), seed, 300, flip_at=150)
    after = picks[150:]
    settled = next((j for j in range(len(after) - 10) if (after[j : j + 10] == 1).all()), None)
    assert settled is not None and settled <= FLIP_BOUND
    assert (after[FLIP_BOUND + 10 :] == 1).mean() >= 0.85


def test_undiscounted_thompson_is_slower_to_recover_than_discounted() -> None:
    # The point of discounting: with discount 1 the stale history of the old best arm holds it in place.
    def mean_settle(discount: float) -> float:
        out = []
        for seed in range(10):
            after = play(learner(DiscountedThompson, seed, discount=discount), seed, 400, flip_at=200)[200:]
            out.append(
                next((j for j in range(len(after) - 10) if (after[j : j + 10] == 1).all()), len(after))
            )
        return float(np.mean(out))

    assert mean_settle(0.9) < mean_settle(1.0)


def test_same_seed_same_choices() -> None:
    assert (
        play(learner(DiscountedThompson, 7), 7, 100) == play(learner(DiscountedThompson, 7), 7, 100)
    ).all()


def test_static_plays_its_arm_or_the_nearest() -> None:
    s = learner(Static, 0, arm="ngram:4")
    assert ARMS[s.select("c", [0, 1])] == Arm.parse("ngram:4")
    s = learner(Static, 0, arm="ngram:2")
    assert ARMS[s.select("c", [0, 1])] == Arm.parse("ngram:4")


def test_learner_state_round_trips() -> None:
    a = learner(DiscountedThompson, 3)
    play(a, 3, 50)
    b = learner(DiscountedThompson, 3)
    b.load_state_dict(a.state_dict())
    assert np.allclose(a.estimates("ctx"), b.estimates("ctx"))


def test_registry_names() -> None:
    assert set(REGISTRY) >= {"static", "epsilon_greedy", "discounted_thompson"}
