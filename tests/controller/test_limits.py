"""The rate limits of controller/limits.py on a fake clock: a token bucket, and an engine's report
budget of steps and request-steps, where a refused batch spends nothing of either."""

from __future__ import annotations

from controller.limits import ReportLimit, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_at_its_rate_up_to_its_burst_and_can_take_spends_nothing() -> None:
    clock = Clock()
    b = TokenBucket(rate=10.0, burst=20.0, clock=clock)
    assert b.can_take(20) and b.can_take(20)  # asked twice: still all there
    assert b.take(15) and not b.take(10) and b.take(5)
    clock.now += 1.0
    assert not b.can_take(11) and b.take(10)
    clock.now += 100.0
    assert not b.take(21) and b.take(20)  # never more than the burst saved up


def test_a_batch_over_either_budget_is_refused_naming_it_and_spends_from_neither() -> None:
    clock = Clock()
    limit = ReportLimit(
        steps=TokenBucket(rate=1.0, burst=10.0, clock=clock),
        request_steps=TokenBucket(rate=1.0, burst=100.0, clock=clock),
    )
    assert limit.take(5, 200) == "request_steps"  # its steps were not spent...
    assert limit.take(10, 10) == ""  # ...so all 10 are still there
    assert limit.take(1, 1) == "steps"
    assert limit.take(0, 90) == ""  # and the refused step spent no request-steps
    assert limit.take(0, 1) == "request_steps"
