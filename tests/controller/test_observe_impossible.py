"""The observe adapter against /metrics that no vLLM can render, served over real HTTP to a real
sidecar: draft positions missing, intervals whose counters contradict each other (more tokens accepted
than drafted, a position accepted more often than drafts were verified), counters beyond float
precision, several models in one exposition; a wall clock that jumps between scrapes; a body in an
encoding it did not ask for (a proxy's gzip, a gzip bomb); a redirect to another scheme. What must hold: such a scrape is refused or such an
interval skipped, saying what and where, the observer goes on, and no report made from it reaches the
sidecar."""

import asyncio
import contextlib
import gzip
import http.server
import inspect
import itertools
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from controller.observe import (
    ObserverError,
    ObserverSettings,
    observation_between,
    parse_metrics,
    run_observer,
)
from controller.server import SidecarServer as Sidecar
from policies.arms import Method
from tests.controller.test_observe_hostile import started as started  # a fixture, shared
from tests.integration.test_observe_adapter import _settings, sidecar  # noqa: F401 (a fixture)

_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def _text(
    drafts: float,
    draft_tokens: float,
    accepted: float,
    per_position: dict[int, float],
    iterations: float,
    *,
    labels: str = 'engine="0",model_name="m"',
) -> str:
    """One engine's counters in vLLM's exposition, the per-position ones only at the positions given."""
    lines = [
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
        *(f'{_PER_POS}{{{labels},position="{i}"}} {v}' for i, v in per_position.items()),
        f"vllm:iteration_tokens_total_count{{{labels}}} {iterations}",
    ]
    return "\n".join(lines) + "\n"


def _good(n: int, *, base: float = 0.0, labels: str = 'engine="0",model_name="m"') -> str:
    """``n`` intervals of 100 drafts of K=4 (50 accept one, 25 two, 25 all four), 25 iterations each."""
    pos = {0: 100 * n, 1: 50 * n, 2: 25 * n, 3: 25 * n}
    return _text(
        base + 100 * n,
        base + 400 * n,
        base + 200 * n,
        {i: base + v for i, v in pos.items()},
        base + 25 * n,
        labels=labels,
    )


class _Script:
    """Serves the bodies in order, then the last one again (idle intervals), counting the scrapes."""

    def __init__(self, bodies: Sequence[str]) -> None:
        self.bodies = list(bodies)
        self.served = 0

    def next_body(self) -> bytes:
        body = self.bodies[min(self.served, len(self.bodies) - 1)]
        self.served += 1
        return body.encode()


@contextlib.contextmanager
def _http(answer: Callable[[], tuple[dict[str, str], bytes]], *, status: int = 200) -> Iterator[str]:
    """A real HTTP server on loopback answering every GET with ``status`` and ``answer()``'s headers
    and body; yields its /metrics URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fields, body = answer()
            self.send_response(status)
            for k, v in fields.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):  # (the reader may hang up on a bomb)
                self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    finally:
        srv.shutdown()
        srv.server_close()


def _serving(script: _Script) -> contextlib.AbstractContextManager[str]:
    return _http(lambda: ({"Content-Type": "text/plain; version=0.0.4"}, script.next_body()))


async def _observe(
    server: Sidecar, bodies: Sequence[str], *, observer: dict[str, Any] | None = None, **kw: object
) -> tuple[int, list[str], str]:
    """Observations sent, the lines said and the URL, once the observer has read every body (each scrape
    5 s after the last on the interval clock). ``observer``: more arguments of run_observer."""
    script = _Script(bodies)
    ticks = itertools.count()
    said: list[str] = []
    stop = asyncio.Event()
    with _serving(script) as url:
        settings = _settings(url, server.engine_target, interval_s=0.01, **kw)
        task = asyncio.create_task(
            run_observer(
                settings,
                on_status=said.append,
                stop=stop,
                clock=lambda: 5.0 * next(ticks),
                **(observer or {}),
            )
        )
        try:
            for _ in range(1000):
                if script.served > len(bodies) + 1 or task.done():
                    break
                await asyncio.sleep(0.01)
        finally:
            stop.set()
        sent = await asyncio.wait_for(task, 10)
    return sent, said, url


def _steps(server: Sidecar) -> int:
    st = server.engines().get("plain-vllm")
    return 0 if st is None else st.loop.totals.steps


# -- draft positions missing: vLLM keeps a counter for every position 0..K-1 of every engine


async def test_a_draft_position_missing_refuses_the_scrape_and_the_observer_goes_on(
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    """Position 1 missing from the third scrape was read as 0: the interval's drafts that accepted two
    or more tokens were reported as accepting one (positions 2 and 3 cut at the gap)."""
    gap = _good(2).replace(f'{_PER_POS}{{engine="0",model_name="m",position="1"}} 100.0\n', "")
    assert gap != _good(2)
    sent, said, url = await _observe(sidecar, [_good(0), _good(1), gap, _good(3)])
    refused = [m for m in said if m.startswith(f"cannot read {url}")]
    assert len(refused) == 1 and "position 1 missing" in refused[0], said
    assert _PER_POS in refused[0] and 'engine="0"' in refused[0]
    assert sent == 2  # 0 -> 1, then 1 -> 3 across the refused scrape
    assert _steps(sidecar) == 25 + 50  # (100 drafts in steps of 4, then 200)
    assert sidecar.engines()["plain-vllm"].rejected == 0


def test_a_position_one_engine_lacks_is_missing_even_when_another_has_it() -> None:
    """Data parallel: engine 1 without position 2 was summed as if it had accepted nothing there."""
    two = _good(1) + _good(1, labels='engine="1",model_name="m"').replace(
        f'{_PER_POS}{{engine="1",model_name="m",position="2"}} 25.0\n', ""
    )
    with pytest.raises(ValueError, match=r'position 2 missing .*engine="1"'):
        parse_metrics(two, time_s=0.0)
    # Fewer positions at every engine is a smaller K, not a gap.
    k2 = _text(100, 200, 150, {0: 100, 1: 50}, 25)
    assert parse_metrics(k2, time_s=0.0).per_position == (100.0, 50.0)


# -- intervals whose counters contradict each other: each draft has a token at least, a draft's accepted
# tokens are a prefix of its draft (position i + 1 is accepted only where i was), vLLM adds a step's
# accepted tokens to the total and to their positions at once


_FIELDS = ("drafts", "draft_tokens", "accepted", "iterations", "pos0", "pos1", "pos2", "pos3")


@st.composite
def _interval(draw: st.DrawFn) -> tuple[dict[str, int], dict[str, int]]:
    """A real interval of K=4 drafts (the drafts by accepted count), then maybe one counter moved off."""
    hist = draw(st.lists(st.integers(0, 300), min_size=5, max_size=5))
    drafts = sum(hist)
    pos = [sum(hist[j] for j in range(i + 1, 5)) for i in range(4)]
    real = {"drafts": drafts, "draft_tokens": 4 * drafts, "accepted": sum(pos),
            "iterations": max(1, drafts // 4), **{f"pos{i}": v for i, v in enumerate(pos)}}  # fmt: skip
    base = draw(st.fixed_dictionaries(dict.fromkeys(_FIELDS, st.integers(0, 10**6))))
    moved = draw(st.sampled_from((None, *_FIELDS)))
    if moved is not None:
        real[moved] = max(0, real[moved] + draw(st.integers(-500, 500)))
    return base, real


def _possible(d: dict[str, int]) -> bool:
    pos = [d[f"pos{i}"] for i in range(4)]
    return (
        d["iterations"] >= (d["drafts"] > 0)  # drafts are verified in engine steps
        and d["draft_tokens"] >= d["drafts"]
        and d["accepted"] == sum(pos) <= d["draft_tokens"]
        and all(a >= b for a, b in itertools.pairwise([d["drafts"], *pos]))
    )


def _render(c: dict[str, int]) -> str:
    return _text(c["drafts"], c["draft_tokens"], c["accepted"], {i: c[f"pos{i}"] for i in range(4)},
                 c["iterations"])  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(interval=_interval())
# 100 drafts verified in no engine step (vllm:iteration_tokens_total_count, observed in the same record
# call, did not grow): reported as steps of one request each, a batch nobody measured.
@example(
    interval=(dict.fromkeys(_FIELDS, 0),
              {"drafts": 100, "draft_tokens": 400, "accepted": 200, "iterations": 0, "pos0": 100, "pos1": 50,
               "pos2": 25, "pos3": 25}),
)  # fmt: skip
def test_an_interval_no_engine_counts_is_skipped_never_reported(
    interval: tuple[dict[str, int], dict[str, int]],
) -> None:
    """More tokens accepted than drafted, a position accepted in more drafts than were verified or more
    often than the one before it, fewer draft tokens than drafts, a total other than its positions' sum,
    drafts verified in no engine step: each was capped or ignored and reported (100 drafts of one draft token each, 400 tokens accepted,
    went to the sidecar as 100 drafts of K=4 accepting all four)."""
    base, delta = interval
    prev = parse_metrics(_render(base), time_s=0.0)
    cur = parse_metrics(_render({f: base[f] + delta[f] for f in _FIELDS}), time_s=5.0)
    try:
        obs = observation_between(prev, cur, method=Method.EAGLE3, max_k=4)
    except ValueError as e:
        assert not _possible(delta) or delta["drafts"] == 0, e
        assert "impossible interval" in str(e) or "no engine verifies" in str(e), e
        return
    if obs is None:
        assert delta["drafts"] == 0
        return
    assert _possible(delta), delta
    # The rows say what the counters say: the mean accepted per draft (largest-remainder rounding of
    # the histogram to obs.n rows moves it by under K (K + 1) / 2 / n).
    assert abs(float(np.mean(obs.accepted)) - delta["accepted"] / delta["drafts"]) <= 10 / obs.n


async def test_more_tokens_accepted_than_drafted_is_a_skipped_interval_saying_so(
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    """The third scrape's interval accepted 1,000 tokens of 400 drafted (positions as well): it was
    reported as 100 drafts accepting all four."""
    bad = _text(200, 800, 1200, {0: 200, 1: 350, 2: 325, 3: 325}, 50)
    after = _text(300, 1200, 1400, {0: 300, 1: 400, 2: 350, 3: 350}, 75)
    sent, said, url = await _observe(sidecar, [_good(0), _good(1), bad, after])
    skipped = [m for m in said if m.startswith("skipped")]
    assert len(skipped) == 1, said
    assert skipped[0].startswith(f"skipped the interval from {url}: impossible interval: "), skipped
    assert "vllm:spec_decode_num_accepted_tokens_total grew by 1000, more than" in skipped[0], skipped
    assert sent == 2 and _steps(sidecar) == 50  # 0 -> 1 and the interval after the bad one
    assert sidecar.engines()["plain-vllm"].rejected == 0


# -- counts beyond float precision, or not whole: prometheus_client keeps a counter in a double, exact to
# 2^53; no engine counts that far (2^53 drafts are 285 years at a million a second)


async def test_counters_beyond_2_to_the_53_are_refused_not_differenced(
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    """Counters near 2^60 growing by 100 drafts an interval: doubles 256 apart there, so the deltas were
    0 or 256 and the positions' deltas noise; the reports were sent (512 rows of a made-up histogram)."""
    bodies = [_good(n, base=2.0**60) for n in range(4)]
    with pytest.raises(
        ObserverError, match=r"vllm:spec_decode_num_drafts_total\{.*\}: must be at most 2\^53"
    ):
        await _observe(sidecar, bodies)
    assert _steps(sidecar) == 0


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.5', "a whole number"),
        ('vllm:iteration_tokens_total_count{engine="0",model_name="m"} 1e300', "at most 2^53"),
        (f'{_PER_POS}{{engine="0",model_name="m",position="0"}} 9007199254740994', "at most 2^53"),
        ('vllm:num_requests_waiting{engine="0",model_name="m"} 0.25', "a whole number"),
    ],
)
def test_a_count_that_is_not_whole_or_beyond_2_to_the_53_refuses_the_scrape(line: str, says: str) -> None:
    name = line.partition("{")[0]
    text = "\n".join(x for x in _good(1).splitlines() if not x.startswith(line.partition(" ")[0]))
    with pytest.raises(ValueError, match=rf"^{name}\{{.*\}}: must be {re.escape(says)}"):
        parse_metrics(text + "\n" + line + "\n", time_s=0.0)


def test_counts_up_to_2_to_the_53_and_a_fractional_queue_time_are_read() -> None:
    top = 2.0**53
    text = _good(1) + 'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 12.345\n'
    text += 'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 9007199254740992\n'
    c = parse_metrics(text, time_s=0.0)
    assert (c.queue_time_sum, c.queue_time_count) == (12.345, top)


# -- several models in one exposition (two vLLMs behind one proxy, a federated /metrics): their counters
# are not one engine's, and summed they made an engine that does not exist


def _two_models(n: int) -> str:
    """Model a, K=4, and model b, whose drafts accept nothing, ``n`` intervals old."""
    b = _text(100 * n, 100 * n, 0, {0: 0}, 100 * n, labels='engine="0",model_name="b"')
    return _good(n, labels='engine="0",model_name="a"') + b


async def test_several_models_are_refused_unless_one_is_chosen(
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    """Both models' counters were summed: 200 drafts an interval, half accepting nothing, sent to the
    sidecar as one engine's."""
    bodies = [_two_models(n) for n in range(3)]
    with pytest.raises(
        ObserverError, match=r"model_name: 2 models in one exposition \('a', 'b'\).*--model-name"
    ):
        await _observe(sidecar, bodies)
    assert _steps(sidecar) == 0
    # One chosen: its counters alone (100 drafts of K=4 an interval, in steps of 4).
    sent, said, _ = await _observe(sidecar, bodies, model_name="a")
    assert sent == 2 and _steps(sidecar) == 2 * 25, said


def test_a_model_name_the_exposition_lacks_refuses_the_scrape_naming_those_it_has() -> None:
    """--model-name misspelt read as an exposition without counters: 'no speculative decoding counters
    yet', for good."""
    with pytest.raises(
        ValueError, match=r"model_name: no sample of the counters read for 'c' \(there are 'a', 'b'\)"
    ):
        parse_metrics(_two_models(1), time_s=0.0, model="c")
    assert parse_metrics(_two_models(1), time_s=0.0, model="b").drafts == 100.0


def test_observe_model_name_is_passed_and_a_bad_one_is_a_one_line_usage_error(
    started: list[ObserverSettings], capsys: pytest.CaptureFixture[str]
) -> None:
    from controller.cli import main

    got = started
    argv = [
        "observe",
        "--metrics-url",
        "http://127.0.0.1:9/metrics",
        "--sidecar",
        "127.0.0.1:9",
        "--engine-id",
        "e",
    ]
    assert main(argv) == 0 and got[-1].model_name is None
    assert main([*argv, "--model-name", "meta-llama/Llama-3.1-8B"]) == 0
    assert got[-1].model_name == "meta-llama/Llama-3.1-8B"
    capsys.readouterr()
    for bad in ("", "a\x1bb", "x" * 513):
        assert main([*argv, f"--model-name={bad}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --model-name: must be 1..512 characters") and err.count("\n") == 1, err


# -- the clocks: an interval is timed on a steady clock; the wall clock (NTP steps it, an operator sets it)
# only stamps the reports, as the plugin stamps its steps


async def test_a_wall_clock_that_jumps_changes_no_interval(
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    """time.time() timed the intervals: stepped an hour forward between two scrapes, 100 drafts were
    sent as lasting an hour (a goodput 720 times too low, learnt); stepped back, the interval was
    dropped without a word."""
    assert inspect.signature(run_observer).parameters["clock"].default is time.monotonic
    walls = itertools.chain([1.7e9, 1.7e9 + 3600, 1.7e9 - 86400, 1.7e9 + 5], itertools.count(1.8e9))
    sent, said, _ = await _observe(
        sidecar, [_good(n) for n in range(5)], observer={"wall": lambda: next(walls)}
    )
    assert sent == 4, said
    totals = sidecar.engines()["plain-vllm"].loop.totals
    # Every interval lasted its 5 s of the steady clock (each of its 100 rows 1/100 of it).
    assert totals.steps == 4 * 25 and totals.busy_s == pytest.approx(4 * 5.0)


# -- encodings: urllib asks for none (Accept-Encoding: identity); a proxy may gzip anyway


def _encoded(body: bytes, encoding: str) -> contextlib.AbstractContextManager[str]:
    return _http(lambda: ({"Content-Encoding": encoding}, body))


def test_a_gzipped_body_is_read_and_a_gzip_bomb_refused_at_8_mib() -> None:
    """A gzipped body was parsed as text: 'not Prometheus text: invalid metric name:\\x1f\ufffd...'."""
    from controller.observe import MAX_BODY_BYTES, scrape

    with _encoded(gzip.compress(_good(3).encode()), "gzip") as url:
        assert parse_metrics(scrape(url), time_s=0.0).drafts == 300.0
    bomb = gzip.compress(b"#" * (100 * 1024 * 1024), compresslevel=9)  # 100 MB in ~100 kB
    with _encoded(bomb, "gzip") as url, pytest.raises(ValueError, match=f"over {MAX_BODY_BYTES} bytes"):
        scrape(url)
    cut = gzip.compress(_good(3).encode())[:-20]
    with _encoded(cut, "x-gzip") as url, pytest.raises(ValueError, match=r"^gzip body: cut short"):
        scrape(url)
    with (
        _encoded(b"\x1f\x8bnot gzip at all", "gzip") as url,
        pytest.raises(ValueError, match=r"^gzip body: "),
    ):
        scrape(url)


@pytest.mark.parametrize("encoding", ["br", "deflate", "zstd", "gzip, br"])
def test_an_encoding_other_than_gzip_is_refused_naming_it(encoding: str) -> None:
    from controller.observe import scrape

    says = rf"^Content-Encoding '{encoding}': not read \(none or gzip\)"
    with _encoded(_good(1).encode(), encoding) as url, pytest.raises(ValueError, match=says):
        scrape(url)


# -- redirects: urllib follows 3xx to ftp:// as well as http(s)


def test_a_redirect_to_ftp_is_not_followed() -> None:
    """A /metrics answering 302 to ftp://host:port/ made the observer log in there (anonymous FTP, at a
    host and port of the server's choosing) and wait 5 s for its banner."""
    from controller.observe import scrape

    with socket.socket() as ftp:
        ftp.bind(("127.0.0.1", 0))
        ftp.listen()
        ftp.setblocking(False)
        target = f"ftp://127.0.0.1:{ftp.getsockname()[1]}/metrics"

        says = rf"a redirect to '{re.escape(target)}' is not followed \(http or https only\)"
        with (
            _http(lambda: ({"Location": target}, b""), status=302) as url,
            pytest.raises(OSError, match=says),
        ):
            scrape(url, timeout_s=1.0)
        with pytest.raises(BlockingIOError):  # nobody connected to the FTP port
            ftp.accept()


# -- a series that comes back: absent from one scrape (a proxy's partial scrape, an exporter's hiccup),
# present at the next with all it counted meanwhile and before


def _two_engines(n: int, *, second: bool = True) -> str:
    return _good(n) + (_good(n, labels='engine="1",model_name="m"') if second else "")


async def test_a_series_back_after_a_scrape_without_it_is_not_counted_whole(
    sidecar: Sidecar,  # noqa: F811 (the integration tests' fixture, imported above)
) -> None:
    """Engine 1 missing from the third scrape (that interval skipped: the sums went back), back at the
    fourth: the interval from the third counted engine 1's whole lifetime (1,300 drafts at scrape 13, in
    5 s), and reports of it were sent."""
    bodies = [
        _two_engines(10),
        _two_engines(11),
        _two_engines(12, second=False),
        _two_engines(13),
        _two_engines(14),
    ]
    sent, said, url = await _observe(sidecar, bodies)
    skipped = [m for m in said if m.startswith("skipped")]
    assert len(skipped) == 2, said
    assert "went backwards" in skipped[0]
    assert skipped[1].startswith(
        f"skipped the interval from {url}: vllm:spec_decode_num_drafts_total"
        '{engine="1",model_name="m"} appeared with 1300'
    ), skipped
    assert sent == 2 and _steps(sidecar) == 2 * 50  # 10 -> 11 and 13 -> 14: 200 drafts each, steps of 4


# -- any sequence of scrapes: engines that grow, restart (their _created time changes), drop out of a
# scrape and come back; every observation made is one real interval's, exactly


class _Engine:
    """One data-parallel engine's counters (K=4) as the exposition shows them."""

    def __init__(self, index: int, created: float) -> None:
        self.labels = f'engine="{index}",model_name="m"'
        self.created = created
        self.c = dict.fromkeys(_FIELDS, 0)

    def grow(self, hist: list[int]) -> None:
        drafts = sum(hist)
        pos = [sum(hist[j] for j in range(i + 1, 5)) for i in range(4)]
        for f, v in (("drafts", drafts), ("draft_tokens", 4 * drafts), ("accepted", sum(pos)),
                     ("iterations", -(-drafts // 4)), *((f"pos{i}", p) for i, p in enumerate(pos))):  # fmt: skip
            self.c[f] += v

    def text(self) -> str:
        c = self.c
        return _text(c["drafts"], c["draft_tokens"], c["accepted"], {i: c[f"pos{i}"] for i in range(4)},
                     c["iterations"], labels=self.labels) + (
            f"vllm:spec_decode_num_drafts_created{{{self.labels}}} {self.created}\n"
        )  # fmt: skip


_HIST = st.lists(st.integers(0, 60), min_size=5, max_size=5)
#: A restarted engine verifies a draft at least before the next scrape. (Left out of the scrape before
#: its restart and still at zero drafts after it, it leaves nothing to tell: no _created time to
#: compare, no count to have appeared; what it drafted before the restart is lost unseen.)
_RESTART_HIST = _HIST.filter(lambda h: sum(h) > 0)
_EVENT = st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 1), _HIST),
    st.tuples(st.just("restart"), st.integers(0, 1), _RESTART_HIST),
    st.tuples(st.just("hide"), st.integers(0, 1), st.just([])),
)


def _accepted(hist: list[int]) -> int:
    return sum(j * n for j, n in enumerate(hist))


@settings(max_examples=300, deadline=None)
@given(scrapes=st.lists(st.lists(_EVENT, max_size=3), min_size=2, max_size=8))
# Engine 1 at zero drafts, then left out of the scrape in which it drafted 5: the interval was
# reported as engine 0's alone (a series gone from 0 was not "gone back"), the server's rate halved.
@example(scrapes=[[("grow", 0, [0, 0, 0, 0, 5])], [("grow", 0, [0, 0, 0, 0, 5]), ("grow", 1, [0, 0, 0, 0, 5]), ("hide", 1, [])]])  # fmt: skip
# Engine 1 left out of every scrape so far while it drafted: nothing tells the observer it exists.
# (And left out of two scrapes after one that showed it: gone to the observer, see the test.)
@example(scrapes=[[], [("hide", 1, []), ("grow", 0, [0, 0, 0, 0, 0])], [("hide", 1, []), ("grow", 0, [0, 0, 0, 0, 1]), ("grow", 1, [0, 0, 0, 0, 1])]])  # fmt: skip
@example(scrapes=[[("grow", 0, [0, 0, 0, 0, 0]), ("hide", 1, [])], [("grow", 0, [0, 0, 0, 0, 1]), ("grow", 1, [0, 0, 0, 0, 1]), ("hide", 1, [])]])  # fmt: skip
# Engine 0 left out of both scrapes, drafting or restarting unseen (found by the clean-clone CI).
@example(scrapes=[[("hide", 0, [])], [("grow", 0, [0, 0, 0, 0, 1]), ("grow", 1, [0, 0, 0, 0, 1]), ("hide", 0, [])]])  # fmt: skip
@example(scrapes=[[("hide", 0, [])], [("grow", 1, [0, 0, 0, 0, 1]), ("restart", 0, [0, 0, 0, 0, 1]), ("hide", 0, [])]])  # fmt: skip
# Both left out of a scrape (no baseline) while engine 0 drafted: the next interval runs from the one before.
@example(scrapes=[[], [("hide", 0, []), ("hide", 1, []), ("grow", 0, [0, 0, 0, 0, 1])], []])  # fmt: skip
def test_any_sequence_of_scrapes_yields_only_real_intervals(
    scrapes: list[list[tuple[str, int, list[int]]]],
) -> None:
    """Between scrapes, each of two engines grows, restarts (and may count past its old totals) or is
    left out of the scrape; the observer's baseline rule is followed (a skipped interval moves the
    baseline). Every observation made holds exactly the drafts and accepted tokens the engines counted
    in its interval: never a restart's, a vanished series' lifetime, part of the interval, a negative
    count or more accepted than drafted."""
    engines = [_Engine(0, 1.0), _Engine(1, 1.0)]
    clock = itertools.count(1)
    prev = None
    shown_then: set[int] = set()  # the engines the baseline scrape showed
    # What each engine verified since the observer's baseline (the last scrape with drafts: one
    # without any vLLM drafts counter is no baseline), and whether it restarted since.
    grown, grown_accepted, restarted = [0, 0], [0, 0], [False, False]
    for events in scrapes:
        hidden = set()
        for kind, e, hist in events:
            if kind == "restart":
                engines[e] = _Engine(e, float(next(clock)) + 1.0)
                restarted[e] = True
            if kind in ("grow", "restart"):
                engines[e].grow(hist)
                grown[e] += sum(hist)
                grown_accepted[e] += _accepted(hist)
            else:
                hidden.add(e)
        shown = {0, 1} - hidden
        text = "".join(eng.text() for i, eng in enumerate(engines) if i not in hidden)
        try:
            cur = parse_metrics(text, time_s=5.0 * next(clock))
        except ValueError as e:
            raise AssertionError(f"a scrape vLLM renders was refused: {e}") from None
        if prev is not None and cur.has_drafts:
            try:
                obs = observation_between(prev, cur, method=Method.EAGLE3, max_k=4)
            except ValueError:
                obs = None
            if obs is not None:
                # Gone from this scrape, or back in it with counts: the interval is no data.
                assert not shown_then - shown
                assert all(engines[e].c["drafts"] == 0 for e in shown - shown_then)
                # Left out of both scrapes, an engine is gone to the observer (it may have been scaled
                # away; the interval after the one it left is the others'): what it verified unseen
                # is in no interval.
                both = shown & shown_then
                assert not any(restarted[e] for e in both)
                drafts = sum(grown[e] for e in both)
                accepted = sum(grown_accepted[e] for e in both)
                assert obs.n == min(512, drafts), (obs.n, drafts)
                assert (obs.accepted <= obs.drafted).all() and (obs.accepted >= 0).all()
                assert abs(float(np.mean(obs.accepted)) - accepted / drafts) <= 10 / obs.n
        if cur.has_drafts:
            prev, shown_then = cur, shown
            grown, grown_accepted, restarted = [0, 0], [0, 0], [False, False]
