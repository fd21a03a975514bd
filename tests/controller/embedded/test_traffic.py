import numpy as np
import pytest

from controller.embedded.traffic import (
    ACC_CAP,
    DEFAULT_CLASSES,
    Phase,
    Schedule,
    Traffic,
    _acc,
    demo_traffic,
)
from policies.arms import Method


def _traffic(mix: dict[str, float], seed: int = 0) -> Traffic:
    return Traffic(classes=DEFAULT_CLASSES, schedule=Schedule((Phase(10.0, mix, 4),)), seed=seed)


def test_same_seed_same_requests_and_different_seed_differs() -> None:
    a, b, c = demo_traffic(seed=3), demo_traffic(seed=3), demo_traffic(seed=4)
    ra, rb, rc = a.request(1, 7), b.request(1, 7), c.request(1, 7)
    assert (ra.traffic_class, ra.prompt_tokens, ra.output_tokens) == (
        rb.traffic_class,
        rb.prompt_tokens,
        rb.output_tokens,
    )
    for m in (Method.EAGLE3, Method.NGRAM):
        assert np.array_equal(ra.acc[m], rb.acc[m])
    assert not (
        ra.output_tokens == rc.output_tokens and np.array_equal(ra.acc[Method.EAGLE3], rc.acc[Method.EAGLE3])
    )


def test_acc_follows_the_run_semantics() -> None:
    s = np.array([1, 1, 0, 1, 1, 1, 0, 0, 1], dtype=bool)
    # acc[t] = successes in a row starting at t + 1
    assert _acc(s).tolist() == [1, 0, 3, 2, 1, 0, 0, 1, 0]
    r = _traffic({"code": 1.0}).request(0, 0)
    acc = r.acc[Method.NGRAM]
    assert len(acc) == r.output_tokens and acc[-1] == 0
    uncapped = acc[:-1] < ACC_CAP
    nxt = acc[1:]
    ok = (acc[:-1] == 0) | (acc[:-1] == np.minimum(nxt + 1, ACC_CAP))
    assert ok[uncapped].all()


def _mean_acc(mix: dict[str, float], method: Method) -> float:
    t = _traffic(mix)
    return float(np.mean(np.concatenate([t.request(0, i).acc[method] for i in range(40)])))


def test_classes_differ_in_acceptance_per_method() -> None:
    assert _mean_acc({"code": 1.0}, Method.NGRAM) > 3 * _mean_acc({"chat": 1.0}, Method.NGRAM)
    assert _mean_acc({"chat": 1.0}, Method.EAGLE3) > 3 * _mean_acc({"creative": 1.0}, Method.EAGLE3)
    assert _mean_acc({"chat": 1.0}, Method.EAGLE3) > _mean_acc({"chat": 1.0}, Method.NGRAM)


def test_mix_decides_the_classes() -> None:
    t = _traffic({"maths": 1.0})
    assert {t.request(0, i).traffic_class for i in range(20)} == {"maths"}


def test_schedule_index_and_scaling() -> None:
    s = Schedule((Phase(1.0, {"chat": 1}, 1), Phase(3.0, {"code": 1}, 4))).scaled(8.0)
    assert s.duration_s == pytest.approx(8.0)
    assert [s.index(t) for t in (0.0, 1.9, 2.0, 7.9, 100.0)] == [0, 0, 1, 1, 1]


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown class"):
        _traffic({"poetry": 1.0})
    with pytest.raises(ValueError, match="concurrency"):
        Phase(1.0, {"chat": 1.0}, 0)
