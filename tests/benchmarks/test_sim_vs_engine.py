"""benchmarks/sim_vs_engine.py's run order: every setting once per round, interleaved, one pin per arm."""

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sim_vs_engine as sve  # noqa: E402


def test_every_setting_once_per_round_in_a_new_order() -> None:
    order = sve.run_order(3)
    assert Counter((arm, c) for _, arm, c in order) == {(a, c): 3 for a in sve.ARMS for c in sve.LEVELS}
    rounds = [[(arm, c) for r, arm, c in order if r == i] for i in range(3)]
    assert len({tuple(r) for r in rounds}) == 3  # interleaved: no two rounds in the same order
    for r in rounds:  # an arm's settings run together: one pin per arm and round
        arms = [a for a, _ in r]
        assert [a for i, a in enumerate(arms) if i == 0 or arms[i - 1] != a] == list(dict.fromkeys(arms))
    assert sve.run_order(3) == order  # seeded


def test_the_training_settings_leave_some_held_out() -> None:
    settings = {(a, c) for a in sve.ARMS for c in sve.LEVELS}
    assert settings > sve.TRAIN and len(settings - sve.TRAIN) >= 4
