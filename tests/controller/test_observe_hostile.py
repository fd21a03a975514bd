"""The observe adapter against hostile counters: arbitrary values between two scrapes (counters that go
backwards, denormal, fractional or huge ones), engine restarts behind one endpoint, and settings the
sidecar would refuse. Each interval is skipped saying why, or becomes reports the sidecar accepts."""

import asyncio
import http.server
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controller.observe import (
    MAX_OBSERVED_BATCH,
    ObserverSettings,
    VllmCounters,
    _reports,
    observation_between,
    parse_metrics,
    run_observer,
)
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, validate_batch
from policies.arms import OFF, Arm, Method
from policies.engine import EngineInfo, Granularity
from tests.integration.test_observe_adapter import _settings, sidecar  # noqa: F401 (a fixture)

#: What observation_between says of an interval it skips.
_SKIPS = ("no engine verifies", "steps of more than", "a batch of", "a queue of", "went backwards")

_V = st.one_of(
    st.floats(min_value=0, max_value=1e308, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 5e-324, 1e-300, 0.5, 1.0, 2.0, 3.0, 1e6, 2.0**53, 1e300]),
    st.integers(min_value=0, max_value=2000).map(float),
)


def _counters(time_s: st.SearchStrategy[float]) -> st.SearchStrategy[VllmCounters]:
    # (what parse_metrics can return: finite and >= 0, otherwise anything, in any order between scrapes)
    return st.builds(
        VllmCounters,
        time_s=time_s,
        drafts=_V,
        draft_tokens=_V,
        accepted=_V,
        per_position=st.lists(_V, max_size=6).map(tuple),
        iterations=_V,
        queue_time_sum=_V,
        queue_time_count=_V,
        running=_V,
        waiting=_V,
    )


def _zero(time_s: float, **kw: object) -> VllmCounters:
    return VllmCounters(time_s=time_s, **kw)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prev=_counters(st.just(0.0)),
    cur=_counters(st.sampled_from([1e-9, 1e-3, 1.0, 5.0, 3600.0, 1e5])),
    max_k=st.integers(min_value=1, max_value=64),
    method=st.sampled_from([Method.EAGLE3, Method.NGRAM, Method.P_EAGLE]),
)
# Draft tokens that went back over a denormal number of drafts: round(-inf) raised OverflowError, which
# nothing caught (`observe` died with a traceback).
@example(
    prev=_zero(0.0, draft_tokens=1.0, per_position=(0.0,)),
    cur=_zero(5.0, drafts=5e-324, iterations=1.0, per_position=(0.0,)),
    max_k=4, method=Method.EAGLE3,
)  # fmt: skip
# Drafts that grew by a denormal: inf * 0 rows made a NaN that passed the step check, and an observation
# of no rows was sent.
@example(prev=_zero(0.0), cur=_zero(1e-9, drafts=5e-324), max_k=1, method=Method.EAGLE3)
def test_any_two_scrapes_are_skipped_saying_why_or_become_reports_the_sidecar_accepts(
    prev: VllmCounters, cur: VllmCounters, max_k: int, method: Method
) -> None:
    try:
        obs = observation_between(prev, cur, method=method, max_k=max_k)
    except ValueError as e:
        assert any(p in str(e) for p in _SKIPS), e
        return
    if obs is None:
        return
    # Physically possible: rows, no acceptance above 1, no negative tokens, a real duration.
    assert 1 <= obs.n <= 512
    assert (obs.accepted >= 0).all() and (obs.accepted <= obs.drafted).all() and (obs.drafted <= obs.k).all()
    assert np.isfinite(obs.duration_s) and obs.duration_s > 0
    arms = (*(Arm(method, k) for k in range(1, max_k + 1)), OFF)
    engine = EngineInfo("e", "m", max_k, arms, Granularity.BATCH_STEP, MAX_OBSERVED_BATCH)
    steps = validate_batch(pb.StepReportBatch(sequence=1, steps=_reports(obs)), engine, Limits())
    assert sum(s.n for s in steps) == obs.n


def _scrape(n: int, n1: float | None = None) -> str:
    """Two engines (data parallel) behind one endpoint, each ``n`` scrapes old (engine 1 ``n1`` when
    set: it restarted); each verifies 100 drafts of K=4 per scrape."""
    lines = []
    for engine, m in (("0", n), ("1", n if n1 is None else n1)):
        d = 100 * m
        labels = f'engine="{engine}",model_name="m"'
        lines += [
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {d}",
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {4 * d}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {2 * d}",
            *(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {v}'
                for i, v in enumerate([d, d // 2, d // 4, d // 4])
            ),
            f"vllm:iteration_tokens_total_count{{{labels}}} {25 * m}",
        ]
    return "\n".join(lines) + "\n"


def test_one_engine_restarting_behind_an_endpoint_is_a_skipped_interval() -> None:
    """Engine 0 grew by 600 drafts while engine 1 restarted: every sum still grew, and the interval was
    learnt as 500 drafts (its histogram and step count a mix of two engines' lifetimes)."""
    prev = parse_metrics(_scrape(4), time_s=0.0)
    cur = parse_metrics(_scrape(10, n1=1), time_s=5.0)
    assert cur.drafts > prev.drafts and cur.iterations > prev.iterations
    with pytest.raises(
        ValueError, match=r"vllm:spec_decode_num_drafts_total\[.*engine.*1.*\] went backwards"
    ):
        observation_between(prev, cur, method=Method.EAGLE3, max_k=4)
    # The next interval, from the restarted engine's new counters, is read again.
    later = parse_metrics(_scrape(11, n1=2), time_s=10.0)
    obs = observation_between(cur, later, method=Method.EAGLE3, max_k=4)
    assert obs is not None and obs.n == 200


def test_a_per_position_counter_that_went_back_is_not_read_as_drafts_accepting_nothing() -> None:
    """Drafts grew while the per-position counters reset: the deltas were clipped to 0, and the interval
    was learnt as every draft accepting nothing."""
    prev = _zero(
        0.0, drafts=100.0, draft_tokens=400.0, per_position=(100.0, 50.0, 25.0, 25.0), iterations=25.0
    )
    cur = _zero(5.0, drafts=200.0, draft_tokens=800.0, per_position=(10.0, 5.0, 2.0, 2.0), iterations=50.0)
    with pytest.raises(ValueError, match=r'per_pos_total\{position="0"\} went backwards'):
        observation_between(prev, cur, method=Method.EAGLE3, max_k=4)


def test_draft_tokens_that_went_back_over_a_denormal_draft_count_are_skipped() -> None:
    """It raised OverflowError (round of -inf), which `observe` did not catch: a traceback."""
    prev = _zero(0.0, draft_tokens=1.0, per_position=(0.0,))
    cur = _zero(5.0, drafts=5e-324, iterations=1.0, per_position=(0.0,))
    with pytest.raises(ValueError, match="vllm:spec_decode_num_draft_tokens_total went backwards"):
        observation_between(prev, cur, method=Method.EAGLE3, max_k=4)


def test_less_than_one_draft_is_no_observation_of_no_rows() -> None:
    """A denormal growth of the drafts counter gave an observation of 0 rows (a NaN passed the check)."""
    with pytest.raises(ValueError, match=r"no engine verifies 4\.94066e-324 drafts in 1e-09 s"):
        observation_between(_zero(0.0), _zero(1e-9, drafts=5e-324), method=Method.EAGLE3, max_k=1)


@pytest.mark.parametrize("model", ["a\x1bb", "m\n", "x" * 513])
def test_a_model_the_sidecar_would_refuse_is_a_usage_error(model: str) -> None:
    """It was sent in the Hello, and the sidecar's refusal ended `observe` with exit 1, not 2."""
    with pytest.raises(
        ValueError, match=r"^model: must be at most 512 characters without control characters"
    ):
        ObserverSettings(metrics_url="http://h:1/metrics", engine_target="h:1", engine_id="e", model=model)
    ObserverSettings(metrics_url="http://h:1/metrics", engine_target="h:1", engine_id="e", model="x" * 512)


class _Restarting:
    """A /metrics endpoint whose engine 1 restarts after the third scrape (its counters start over,
    and the sums still grow)."""

    def __init__(self) -> None:
        self.n = 0

    def text(self) -> str:
        n = self.n
        self.n += 1
        return _scrape(n, n if n < 3 else n - 1.5)


@pytest.fixture
def restarting_url() -> Iterator[str]:
    source = _Restarting()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = source.text().encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()
    srv.server_close()


async def test_a_restart_is_said_in_one_line_and_the_observer_goes_on(
    restarting_url: str,
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    said: list[str] = []
    stop = asyncio.Event()
    s = _settings(restarting_url, sidecar.engine_target, interval_s=0.02)
    task = asyncio.create_task(run_observer(s, on_status=said.append, stop=stop))
    try:
        for _ in range(500):
            st_ = sidecar.engines().get("plain-vllm")
            # 2 good intervals before the restart, 2 after, 50 steps each (200 drafts, batches of 4)
            if st_ is not None and st_.loop.totals.steps >= 4 * 50:
                break
            await asyncio.sleep(0.02)
        stop.set()
        sent = await asyncio.wait_for(task, 10)
    finally:
        stop.set()
    skipped = [m for m in said if m.startswith("skipped")]
    assert len(skipped) == 1 and "went backwards (vLLM restarted?)" in skipped[0], said
    assert sent >= 4
