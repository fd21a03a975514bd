"""The observe adapter against hostile counters: arbitrary values between two scrapes (counters that go
backwards, denormal, fractional or huge ones), engine restarts behind one endpoint (told by counters
that went back, or by their _created times), and settings the sidecar would refuse. Each interval is
skipped saying why, or becomes reports the sidecar accepts. And against a hostile /metrics: duplicate
series, NaN/Inf/negative counters and malformed lines refuse the scrape; a 100 MB body is cut off at
8 MiB; an HTTP error or a redirect loop is a retried scrape saying its status; the exposition is
parsed off the event loop. `controllerctl observe --interval` below a second scrapes every second,
saying so; one out of (0, 3600] is a one-line usage error."""

import asyncio
import contextlib
import http.server
import re
import threading
from collections.abc import Iterator
from typing import Any

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
_SKIPS = (
    "no engine verifies", "steps of more than", "a batch of", "a queue of", "went backwards", "impossible interval"
)  # fmt: skip

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
        ValueError, match=r"vllm:spec_decode_num_drafts_total\{.*engine.*1.*\} went backwards"
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
        # (two intervals a scrape: engine 1 starts over at 3 of engine 0's 6, in whole counts)
        return _scrape(2 * n, 2 * n if n < 3 else 2 * n - 3)


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
            # 2 good intervals before the restart, 2 after, 100 steps each (400 drafts, batches of 4)
            if st_ is not None and st_.loop.totals.steps >= 4 * 100:
                break
            await asyncio.sleep(0.02)
        stop.set()
        sent = await asyncio.wait_for(task, 10)
    finally:
        stop.set()
    skipped = [m for m in said if m.startswith("skipped")]
    assert len(skipped) == 1 and "went backwards (vLLM restarted?)" in skipped[0], said
    assert sent >= 4


# -- the real exposition's shape (vLLM 0.32/0.33 through prometheus_client: # HELP/# TYPE, a _created
# gauge beside each counter), duplicate series, restarts told by _created, NaN/Inf, HTTP errors


def _vllm_text(n: int, *, created: float = 1.7e9, engine: str = "0", extra: str = "") -> str:
    """One engine's spec-decode counters as vLLM renders them, ``n`` intervals old (100 drafts of K=4
    per interval, 25 iterations), its counters created at ``created``."""
    labels = f'engine="{engine}",model_name="tiny"'
    d = 100 * n
    lines: list[str] = []
    for name, value in (
        ("vllm:spec_decode_num_drafts", d),
        ("vllm:spec_decode_num_draft_tokens", 4 * d),
        ("vllm:spec_decode_num_accepted_tokens", 2 * d),
    ):
        lines += [
            f"# HELP {name}_total x.",
            f"# TYPE {name}_total counter",
            f"{name}_total{{{labels}}} {float(value)}",
            f"# HELP {name}_created x.",
            f"# TYPE {name}_created gauge",
            f"{name}_created{{{labels}}} {created}",
        ]
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos"
    lines += [f"# HELP {per_pos}_total x.", f"# TYPE {per_pos}_total counter"]
    lines += [
        f'{per_pos}_total{{{labels},position="{i}"}} {float(v)}'
        for i, v in enumerate([d, d // 2, d // 4, d // 4])
    ]
    lines += [f"# HELP {per_pos}_created x.", f"# TYPE {per_pos}_created gauge"]
    lines += [f'{per_pos}_created{{{labels},position="{i}"}} {created}' for i in range(4)]
    lines += [
        "# HELP vllm:iteration_tokens_total x.",
        "# TYPE vllm:iteration_tokens_total histogram",
        f'vllm:iteration_tokens_total_bucket{{{labels},le="+Inf"}} {25.0 * n}',
        f"vllm:iteration_tokens_total_count{{{labels}}} {25.0 * n}",
        f"vllm:iteration_tokens_total_sum{{{labels}}} {125.0 * n}",
        "# HELP vllm:iteration_tokens_total_created x.",
        "# TYPE vllm:iteration_tokens_total_created gauge",
        f"vllm:iteration_tokens_total_created{{{labels}}} {created}",
    ]
    return "\n".join(lines) + "\n" + extra


def test_the_exposition_vllm_renders_is_read_with_its_creation_times() -> None:
    c = parse_metrics(_vllm_text(3), time_s=0.0)
    assert (c.drafts, c.draft_tokens, c.accepted, c.iterations) == (300.0, 1200.0, 600.0, 75.0)
    assert c.per_position == (300.0, 150.0, 75.0, 75.0)
    assert set(c.created.values()) == {1.7e9} and len(c.created) == len(c.series) == 8
    obs = observation_between(c, parse_metrics(_vllm_text(4), time_s=5.0), method=Method.NGRAM, max_k=4)
    assert obs is not None and obs.n == 100 and obs.batch_size == 4


def test_a_series_twice_in_one_scrape_is_refused_not_summed() -> None:
    """The drafts line twice was read as 200 drafts (summed): a silently doubled interval."""
    line = 'vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 100.0\n'
    with pytest.raises(ValueError, match=r"spec_decode_num_drafts_total.*engine.*appears twice"):
        parse_metrics(_vllm_text(1) + line, time_s=0.0)
    pos = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 1\n'
    with pytest.raises(ValueError, match=r"appears twice"):
        parse_metrics(_vllm_text(1) + pos, time_s=0.0)
    gauge = 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 1\n'
    with pytest.raises(ValueError, match=r"num_requests_waiting.*appears twice"):
        parse_metrics(_vllm_text(1) + gauge + gauge, time_s=0.0)
    # The same names under other labels (a second engine) are two series, summed.
    two = parse_metrics(_vllm_text(1) + _vllm_text(1, engine="1"), time_s=0.0)
    assert two.drafts == 200.0


@pytest.mark.parametrize("after", [1, 2, 5, 40])
def test_a_restart_that_counted_past_the_old_totals_is_skipped(after: int) -> None:
    """vLLM restarted between two scrapes and counted past its old totals (a young engine that crashed,
    a long interval): every counter grew, and the interval was learnt as the new lifetime minus the
    old one. Its counters' _created times changed: the interval is skipped, saying so."""
    prev = parse_metrics(_vllm_text(1, created=1.7e9), time_s=0.0)
    cur = parse_metrics(_vllm_text(1 + after, created=1.7e9 + 60), time_s=120.0)
    assert all(cur.series[k] >= v for k, v in prev.series.items())  # nothing went back
    with pytest.raises(ValueError, match=r"spec_decode_num_draft.*started over .*vLLM restarted"):
        observation_between(prev, cur, method=Method.NGRAM, max_k=4)
    # The next interval, within the new lifetime, is read; and an exposition without creation times
    # (prometheus_client's multiprocess mode) is read as before.
    later = parse_metrics(_vllm_text(2 + after, created=1.7e9 + 60), time_s=125.0)
    assert observation_between(cur, later, method=Method.NGRAM, max_k=4) is not None
    bare = [ln for ln in _vllm_text(1).splitlines() if "_created" not in ln]
    bare_next = [ln for ln in _vllm_text(2).splitlines() if "_created" not in ln]
    assert (
        observation_between(
            parse_metrics("\n".join(bare) + "\n", time_s=0.0),
            parse_metrics("\n".join(bare_next) + "\n", time_s=5.0),
            method=Method.NGRAM,
            max_k=4,
        )
        is not None
    )


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1"])
@pytest.mark.parametrize(
    "series",
    [
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:iteration_tokens_total_count",
    ],
)
def test_a_counter_that_is_not_a_count_refuses_the_scrape(series: str, value: str) -> None:
    text = "\n".join(
        re.sub(r"\} [0-9.e+]+$", "} " + value, ln) if ln.startswith(series + "{") else ln
        for ln in _vllm_text(2).splitlines()
    )
    assert text != _vllm_text(2).rstrip("\n")
    with pytest.raises(ValueError, match=re.escape(series) + r": must be a finite number >= 0"):
        parse_metrics(text + "\n", time_s=0.0)


@pytest.mark.parametrize(
    "text",
    [
        'vllm:spec_decode_num_drafts_total{engine="0" 1\n',  # an unclosed label set
        'vllm:spec_decode_num_drafts_total{engine="0"} one\n',  # a value that is no number
        'vllm:spec_decode_num_drafts_total{a="x} 1\n',  # an unterminated label value
        "\x00\x01\x02 binary\n",
    ],
)
def test_a_malformed_exposition_line_refuses_the_scrape_in_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="not Prometheus text") as e:
        parse_metrics(text, time_s=0.0)
    from controller.observe import _reason

    said = _reason(e.value)
    assert "\n" not in said and "\x00" not in said and len(said) <= 300


class _Hostile(http.server.BaseHTTPRequestHandler):
    """/500: a server error; /loop: redirects to itself; /huge: 100 MB of exposition, streamed without a
    length; /metrics: a good scrape."""

    sent = 0  # bytes /huge sent (class-wide: the test reads it)

    def do_GET(self) -> None:
        if self.path == "/500":
            self.send_error(500, "engine exploded")
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
        elif self.path == "/huge":
            self.send_response(200)
            self.end_headers()
            line = b"# HELP padding " + b"x" * 1000 + b"\n"
            with contextlib.suppress(OSError):  # the reader hung up: what is to be seen
                for _ in range(100 * 1024):  # 100 MB
                    self.wfile.write(line)
                    type(self).sent += len(line)
        else:
            body = _vllm_text(1).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def hostile_base() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_100_mb_metrics_is_refused_after_8_mib_not_read_whole(hostile_base: str) -> None:
    from controller.observe import MAX_BODY_BYTES, scrape

    _Hostile.sent = 0
    with pytest.raises(ValueError, match=f"over {MAX_BODY_BYTES} bytes"):
        scrape(hostile_base + "/huge")
    # The reader stopped near the limit (the server's socket buffers aside), not at 100 MB.
    assert _Hostile.sent < 2 * MAX_BODY_BYTES + 8 * 1024 * 1024


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/500", "HTTP 500: engine exploded"),
        ("/loop", "HTTP 302: The HTTP server returned a redirect error that would lead to an infinite loop"),
    ],
)
async def test_an_http_error_or_a_redirect_loop_is_a_retried_scrape_saying_its_status(
    hostile_base: str,
    path: str,
    says: str,
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    """A 500 was said by its reason alone ("cannot read URL: engine exploded"): no status."""
    from controller.observe import ObserverError

    said: list[str] = []
    s = _settings(hostile_base + path, sidecar.engine_target, retries=2)
    with pytest.raises(ObserverError, match=re.escape(says) + r".*gave up after 3 attempts in a row"):
        await asyncio.wait_for(run_observer(s, on_status=said.append), 30)
    retries = [m for m in said if m.startswith("cannot read")]
    assert len(retries) == 2 and all(says in m and "\n" not in m for m in retries), said


async def test_the_exposition_is_parsed_off_the_event_loop(
    hostile_base: str,
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parsing ran on the event loop: an 8 MiB exposition of distinct series takes seconds to parse
    (4.8 s on a 2-core CI machine), all that time stalling the observer's stream and its Ctrl-C."""
    from controller import observe

    threads: list[threading.Thread] = []
    real = observe.parse_metrics

    def spy(text: str, **kw: Any) -> VllmCounters:
        threads.append(threading.current_thread())
        return real(text, **kw)

    monkeypatch.setattr(observe, "parse_metrics", spy)
    stop = asyncio.Event()
    s = _settings(hostile_base + "/metrics", sidecar.engine_target)
    task = asyncio.create_task(run_observer(s, stop=stop))
    try:
        for _ in range(500):  # bounded: 10 s
            if len(threads) >= 2:
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(threads) >= 2 and threading.main_thread() not in threads, threads


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[ObserverSettings]:
    """The settings each `controllerctl observe` run starts its observer with (``run_observer``
    replaced: nothing is scraped or sent)."""
    from controller import observe

    got: list[ObserverSettings] = []

    async def fake(settings: ObserverSettings, **kw: Any) -> int:
        got.append(settings)
        return 0

    monkeypatch.setattr(observe, "run_observer", fake)
    return got


def test_observe_interval_below_a_second_scrapes_every_second_saying_so(
    started: list[ObserverSettings], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--interval 0.001` scraped vLLM's /metrics back to back (each scrape renders every metric)."""
    from controller.cli import main

    got = started
    argv = ["observe", "--metrics-url", "http://127.0.0.1:9/metrics", "--sidecar", "127.0.0.1:9"]
    for interval, expect in (("0.001", 1.0), ("1e-300", 1.0), ("0.999", 1.0), ("1", 1.0), ("2.5", 2.5)):
        assert main([*argv, "--engine-id", "e", "--interval", interval]) == 0
        assert got[-1].interval_s == expect
        err = capsys.readouterr().err
        clamped = expect != float(interval)
        assert ("below the floor of 1 s" in err and "scraping every 1 s" in err) == clamped, err
        assert err.count("\n") == (1 if clamped else 0), err


@pytest.mark.parametrize("interval", ["0", "-1", "-0.5", "nan", "inf", "-inf", "3601", "1e400"])
def test_observe_interval_out_of_range_is_a_one_line_usage_error(
    interval: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller import observe
    from controller.cli import main

    async def never(settings: ObserverSettings, **kw: Any) -> int:
        raise AssertionError("the observer ran")

    monkeypatch.setattr(observe, "run_observer", never)
    argv = ["observe", "--metrics-url", "http://127.0.0.1:9/metrics", "--sidecar", "127.0.0.1:9"]
    assert main([*argv, "--engine-id", "e", f"--interval={interval}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --interval:") and err.count("\n") == 1, err


@pytest.mark.parametrize("max_k", [2, 8])
async def test_a_max_k_other_than_the_positions_vllm_counts_is_said_once(
    hostile_base: str,
    max_k: int,
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    """vLLM drafting 4 positions observed with --max-k 2 (rows cut at 2) or 8 (K 5..8 recommended, which
    vLLM cannot draft) went on without a word."""
    said: list[str] = []
    stop = asyncio.Event()
    s = _settings(hostile_base + "/metrics", sidecar.engine_target, max_k=max_k)
    task = asyncio.create_task(run_observer(s, on_status=said.append, stop=stop))
    try:
        for _ in range(500):  # bounded: 10 s
            if any("draft positions" in m for m in said):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # (several more scrapes: it is said once)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    lines = [m for m in said if "draft positions" in m]
    assert lines == [
        f"{hostile_base}/metrics counts 4 draft positions (vllm:spec_decode_num_accepted_tokens_per_pos_total), "
        f"but max_k (--max-k, the engine's num_speculative_tokens) is {max_k}: recommendations assume {max_k}"
    ], said


async def test_a_max_k_that_matches_says_nothing_of_positions(
    hostile_base: str,
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    said: list[str] = []
    stop = asyncio.Event()
    s = _settings(hostile_base + "/metrics", sidecar.engine_target, max_k=4)
    task = asyncio.create_task(run_observer(s, on_status=said.append, stop=stop))
    try:
        for _ in range(500):  # bounded: 10 s (attached, then a few scrapes more)
            if "plain-vllm" in sidecar.engines():
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert not [m for m in said if "draft positions" in m], said
