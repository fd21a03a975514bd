"""The observe-only adapter: a vLLM /metrics endpoint (served over real HTTP) fed to a real sidecar."""

import asyncio
import contextlib
import itertools
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from controller.cli import _engine_rows
from controller.config import SidecarConfig
from controller.observe import ObserverError, ObserverSettings, run_observer
from controller.server import SidecarServer as Sidecar
from policies.arms import Method
from policies.directive import Directive
from tests.serve_process import serve_process

pytestmark = pytest.mark.integration


class Counters:
    """vLLM counters that grow by one interval's worth at every scrape: 100 drafts of K=4 per scrape,
    40 accept all four, 60 accept one (mean 2.2 accepted per draft)."""

    def __init__(self) -> None:
        self.scrapes = 0

    def text(self) -> str:
        n = self.scrapes
        self.scrapes += 1
        drafts, accepted = 100 * n, 220 * n
        pos = [100 * n, 40 * n, 40 * n, 40 * n]
        lines = [
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {4 * drafts}',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}',
            *(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}'
                for i, v in enumerate(pos)
            ),
            f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {25 * n}',
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {3}',
        ]
        return "\n".join(["# TYPE vllm:spec_decode_num_drafts_total counter", *lines]) + "\n"


def _serve(counters: Counters, *, fail_first: int = 0, body: str | None = None) -> Iterator[str]:
    calls = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            calls[0] += 1
            if calls[0] <= fail_first:
                self.send_error(503, "warming up")
                return
            data = (body if body is not None else counters.text()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()


@pytest.fixture
def metrics_url() -> Iterator[str]:
    yield from _serve(Counters())


async def test_observer_feeds_the_sidecar_which_recommends(metrics_url: str, tmp_path: Path) -> None:
    sidecar = Sidecar(
        config=SidecarConfig(
            engine_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            metrics_listen="",
            state_dir=str(tmp_path),
        )
    )
    await sidecar.start()
    got: list[Directive] = []
    stop = asyncio.Event()
    settings = ObserverSettings(
        metrics_url=metrics_url,
        engine_target=sidecar.engine_target,
        engine_id="plain-vllm",
        method=Method.EAGLE3,
        max_k=4,
        interval_s=0.05,
    )
    task = asyncio.create_task(run_observer(settings, on_directive=got.append, stop=stop))
    try:
        for _ in range(400):
            st = sidecar.engines().get("plain-vllm")
            if st is not None and st.loop.totals.steps >= 50 and got:
                break
            await asyncio.sleep(0.02)
        st = sidecar.engines()["plain-vllm"]
        status = {e.engine_id: e for e in sidecar.status().engines}["plain-vllm"]
        assert status.observe_only and status.connected
        assert "recommends only" in _engine_rows([status])  # what `controllerctl engines` prints
        t = st.loop.totals
        # Every scrape interval: 100 drafts of K=4 (2.2 accepted on average), reported as 25 steps of 4
        # requests (100 drafting request-steps over 25 iterations).
        assert (
            t.steps >= 50
            and t.steps % 25 == 0
            and t.request_steps == 4 * t.steps
            and t.accepted / t.drafted == pytest.approx(2.2 / 4, abs=0.01)
        )
        assert got and got[0].k_table  # a recommendation came back
    finally:
        stop.set()
        sent = await asyncio.wait_for(task, 10)
        await sidecar.stop(snapshot=False)
    assert sent >= 2


# -- unreachable /metrics or sidecar: retries with backoff, clear messages, no recommendation without data


@contextlib.contextmanager
def _closed_port() -> Iterator[int]:
    """A port nobody listens on while the test runs: held bound, not listening (a connection is
    refused), so no other process can take it meanwhile (closed at once, one did under load)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@pytest.fixture
async def sidecar(tmp_path: Path) -> Any:
    sc = Sidecar(
        config=SidecarConfig(
            engine_listen="127.0.0.1:0",
            admin_listen="127.0.0.1:0",
            metrics_listen="",
            state_dir=str(tmp_path),
        )
    )
    await sc.start()
    yield sc
    await sc.stop(snapshot=False)


def _settings(metrics: str, target: str, **kw: Any) -> ObserverSettings:
    opts: dict[str, Any] = {"interval_s": 0.05, "retries": 3, "backoff_s": 0.01, "backoff_max_s": 0.04}
    opts.update(kw)
    return ObserverSettings(metrics_url=metrics, engine_target=target, engine_id="plain-vllm", **opts)


async def test_unreachable_metrics_retries_with_backoff_then_gives_up(sidecar: Sidecar) -> None:
    said: list[str] = []
    got: list[Directive] = []
    with _closed_port() as port:
        url = f"http://127.0.0.1:{port}/metrics"
        with pytest.raises(
            ObserverError, match=r"cannot read http://127\.0\.0\.1:\d+/metrics .*gave up after 4"
        ):
            await asyncio.wait_for(
                run_observer(
                    _settings(url, sidecar.engine_target), on_status=said.append, on_directive=got.append
                ),
                30,
            )
    retries = [m for m in said if m.startswith(f"cannot read {url}")]
    assert [m.rsplit(" in ", 1)[1] for m in retries] == ["0.01 s", "0.02 s", "0.04 s"]  # doubling, capped
    assert all("refused" in m for m in retries), retries
    assert got == []  # no data: no recommendation


async def test_unreachable_sidecar_retries_then_gives_up(metrics_url: str) -> None:
    # Forty times over: a cancel that landed as a pause's timeout fired (Python 3.11's wait_for ate it)
    # left a session's producer blocked on its full outbox, and the observer hung in about one run of
    # ten instead of giving up.
    for _ in range(40):
        said: list[str] = []
        with _closed_port() as port:
            target = f"127.0.0.1:{port}"
            with pytest.raises(
                ObserverError, match=f"cannot reach the sidecar at {target} .*gave up after 4"
            ):
                await asyncio.wait_for(
                    run_observer(_settings(metrics_url, target), on_status=said.append), 30
                )
        assert len([m for m in said if m.startswith(f"sidecar at {target} unreachable")]) == 3


async def test_metrics_that_come_back_are_read_again(sidecar: Sidecar) -> None:
    said: list[str] = []
    stop = asyncio.Event()
    for url in _serve(Counters(), fail_first=2):
        task = asyncio.create_task(
            run_observer(_settings(url, sidecar.engine_target), on_status=said.append, stop=stop)
        )
        for _ in range(500):
            if sidecar.engines().get("plain-vllm") and sidecar.engines()["plain-vllm"].loop.totals.steps:
                break
            await asyncio.sleep(0.02)
        stop.set()
        sent = await asyncio.wait_for(task, 10)
    assert sent >= 1
    assert any("HTTP Error 503" in m or "warming up" in m for m in said), said
    assert f"reading {url} again" in said


async def test_no_spec_counters_no_recommendation(sidecar: Sidecar) -> None:
    said: list[str] = []
    got: list[Directive] = []
    stop = asyncio.Event()
    plain = 'vllm:num_requests_running{engine="0",model_name="m"} 3\n'
    for url in _serve(Counters(), body=plain):
        task = asyncio.create_task(
            run_observer(
                _settings(url, sidecar.engine_target),
                on_status=said.append,
                on_directive=got.append,
                stop=stop,
            )
        )
        for _ in range(500):  # attached, and several scrapes done
            st = sidecar.engines().get("plain-vllm")
            if st is not None and said:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        stop.set()
        sent = await asyncio.wait_for(task, 10)
    assert sent == 0 and got == []
    (msg,) = said  # said once, not every interval
    assert "no speculative decoding counters" in msg and "no recommendation without data" in msg


class AbsurdOnce(Counters):
    """Counters whose third scrape says 10^12 more drafts than the second (in a fraction of a second):
    an interval no engine produces, then a counter that seems to go back (no interval either, said)."""

    def text(self) -> str:
        n = self.scrapes
        text = super().text()
        if n == 2:
            text = text.replace(
                f'drafts_total{{engine="0",model_name="m"}} {100 * n}',
                'drafts_total{engine="0",model_name="m"} 1e12',
            )
        return text


async def test_an_absurd_interval_is_skipped_and_the_observer_goes_on(sidecar: Sidecar) -> None:
    said: list[str] = []
    stop = asyncio.Event()
    for url in _serve(AbsurdOnce()):
        task = asyncio.create_task(
            run_observer(_settings(url, sidecar.engine_target), on_status=said.append, stop=stop)
        )
        for _ in range(500):
            st = sidecar.engines().get("plain-vllm")
            if st is not None and st.loop.totals.steps >= 75:  # three good intervals of 25 steps
                break
            await asyncio.sleep(0.02)
        stop.set()
        sent = await asyncio.wait_for(task, 10)
    assert sent >= 3
    skipped = [m for m in said if m.startswith("skipped")]
    assert len(skipped) == 2, said  # the absurd interval, then the counter back where it was
    assert skipped[0].startswith(f"skipped the interval from {url}: no engine verifies 1e+12 drafts in ")
    assert (
        skipped[1] == f"skipped the interval from {url}: the drafts counter went backwards (vLLM restarted?)"
    )
    st = sidecar.engines()["plain-vllm"]
    assert st.rejected == 0  # every report the observer sent passed the sidecar's validation
    assert st.loop.totals.steps >= 75 and st.loop.totals.steps % 25 == 0


class VanishOnce(Counters):
    """Counters whose third scrape holds no vLLM sample at all (a scrape of a restarting exporter)."""

    def text(self) -> str:
        n = self.scrapes
        text = super().text()
        return 'other_metric{engine="0"} 3\n' if n == 2 else text


async def _observed_rate(sidecar: Sidecar, counters: Counters, engine_id: str) -> tuple[float, int]:
    """Tokens per busy second the sidecar learnt from ``counters``, scraped every 5 s of a fake clock."""
    ticks = itertools.count()
    stop = asyncio.Event()
    for url in _serve(counters):
        settings = ObserverSettings(metrics_url=url, engine_target=sidecar.engine_target, engine_id=engine_id,
                                    interval_s=0.02, retries=3, backoff_s=0.01, backoff_max_s=0.04)  # fmt: skip
        task = asyncio.create_task(run_observer(settings, stop=stop, clock=lambda: 5.0 * next(ticks)))
        for _ in range(500):
            st = sidecar.engines().get(engine_id)
            if st is not None and st.loop.totals.steps >= 100 and counters.scrapes > 4:
                break
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 10)
    t = sidecar.engines()[engine_id].loop.totals
    return t.emitted / t.busy_s, t.steps


class GoneForAWhile(Counters):
    """Counters that vanish from the fourth to the sixth scrape (an exporter restarting), then return."""

    def text(self) -> str:
        n = self.scrapes
        text = super().text()
        return 'other_metric{engine="0"} 3\n' if 3 <= n <= 5 else text


async def test_counters_that_vanish_after_data_are_said_once_and_their_return_too(sidecar: Sidecar) -> None:
    """After data had flowed, counters that vanished made the observer go silent without a word."""
    said: list[str] = []
    stop = asyncio.Event()
    counters = GoneForAWhile()
    for url in _serve(counters):
        task = asyncio.create_task(
            run_observer(_settings(url, sidecar.engine_target), on_status=said.append, stop=stop)
        )
        for _ in range(500):
            if counters.scrapes > 8:
                break
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 10)
    assert said[0].startswith("no speculative decoding counters")  # the first scrape: 0 drafts yet
    assert said[1:] == [
        f"vllm:spec_decode_num_drafts_total is gone from {url}; no data until it is back",
        f"vllm:spec_decode_num_drafts_total is back in {url}",
    ], said


async def test_a_scrape_without_vllm_samples_is_no_baseline(sidecar: Sidecar) -> None:
    """Read as zeros, a scrape that lost every vLLM sample made the next interval carry the engine's
    whole lifetime (goodput nearly doubled for the same traffic); now the interval runs from the scrape
    before it, at the traffic's own rate."""
    steady, _ = await _observed_rate(sidecar, Counters(), "steady")
    vanished, steps = await _observed_rate(sidecar, VanishOnce(), "vanished")
    assert steps >= 100
    assert vanished == pytest.approx(steady, rel=1e-9)


# -- Ctrl-C on `controllerctl observe`: exit 130, nothing else on stderr --------------------------------

_CTL = str(Path(sys.executable).parent / "controllerctl")
_ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _sidecar_process() -> Iterator[str]:
    """A real ``controllerctl serve``; yields its engine address (a Unix socket: a short directory)."""
    with tempfile.TemporaryDirectory(prefix="sc") as tmp, serve_process(Path(tmp)) as endpoints:
        yield endpoints["engine"]


def test_ctrl_c_at_any_moment_exits_130_quietly() -> None:
    """Ctrl-C pressed at spread moments (as the observer starts and connects, between scrapes, while it
    streams), once or as a quick burst (a second press arriving while the first one's shutdown runs).

    asyncio.run's own SIGINT handler raised KeyboardInterrupt wherever a second press found the loop:
    inside gRPC's request-iterator task ("Task exception was never retrieved ... KeyboardInterrupt" on
    stderr), in asyncio's shutdown (a traceback, exit 1), or leaving a task half shut down that the
    shutdown then waited on for good (a hang). Now the first press cancels the observer and the next one
    ends the process at once (SIGINT's default action)."""
    problems: list[str] = []
    counters = Counters()
    with _sidecar_process() as target:
        for url in _serve(counters):
            for i, delay in enumerate((0.0, 0.05, 0.15, 0.3, 0.5, 0.8, 1.1, 1.5, 2.0, 2.5)):
                burst = i % 3 != 0
                problem = _interrupt_observer(url, target, f"ctrl-c-{i}", counters, delay=delay, burst=burst)
                if problem:
                    problems.append(f"delay {delay} s, {'a burst' if burst else 'one press'}: {problem}")
    assert not problems, "\n\n".join(problems)


def _interrupt_observer(
    url: str, target: str, engine_id: str, counters: Counters, *, delay: float, burst: bool
) -> str | None:
    """Start ``controllerctl observe``, press Ctrl-C ``delay`` s later (once, or three times 0.2 ms
    apart), and say what went wrong, if anything."""
    scrapes = counters.scrapes
    args = ["--metrics-url", url, "--sidecar", target, "--engine-id", engine_id, "--interval", "0.05"]
    p = subprocess.Popen(
        [_CTL, "observe", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=_ROOT
    )
    assert p.stdout is not None
    try:
        # Its first line comes once the CLI runs (a press during the interpreter's imports is Python's
        # own business, before any of the CLI's code).
        first = p.stdout.readline()
        if burst:
            # From its first scrape on, its event loop runs: a burst before that (the process still
            # setting up, in plain Python) is not what this test is about.
            for _ in range(2000):  # bounded: 20 s
                if counters.scrapes > scrapes or p.poll() is not None:
                    break
                time.sleep(0.01)
        time.sleep(delay)
        for _ in range(3 if burst else 1):
            p.send_signal(signal.SIGINT)
            time.sleep(0.0002)
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += "\n(hung: killed after 20 s)"
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    # One press: 130, handled. A burst: 130, or the process ended by a later press itself (SIGINT's
    # default action once interrupted).
    codes = (130,) if not burst else (130, -signal.SIGINT)
    if (
        first.startswith("observing")
        and p.returncode in codes
        and not any(s in err for s in ("Traceback", "never retrieved", "Exception ignored", "hung"))
    ):
        return None
    return f"exit {p.returncode}, first line {first!r}\n{err[-2000:]}"
