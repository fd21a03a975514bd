"""The observe-only adapter: a vLLM /metrics endpoint (served over real HTTP) fed to a real sidecar."""

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from controller.cli import _engine_rows
from controller.config import SidecarConfig
from controller.observe import ObserverSettings, run_observer
from controller.sidecar import Sidecar
from policies.arms import Method
from policies.directive import Directive

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


@pytest.fixture
def metrics_url() -> Iterator[str]:
    counters = Counters()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = counters.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()


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
            if st is not None and st.loop.totals.steps >= 50:
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
