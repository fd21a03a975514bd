"""``trace record`` interrupted (Ctrl-C) mid-way: it stops sending, cuts the requests in flight and
leaves no responses file. What must hold: after the interrupt the server gets no request that had not
been sent when it came, whatever the number of prompts left, and ``record`` returns (re-raising it)
without waiting out the requests in flight."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import sim.record
from sim.record import Prompt, record

GOOD = {
    "usage": {"prompt_tokens": 5, "completion_tokens": 6},
    "choices": [{"text": "......", "prompt_token_ids": [1, 2, 3, 1, 2], "token_ids": [3, 1, 2, 3, 9, 9]}],
    "metrics": {"speculative_decoding": {"per_step_accepted": [2, 0, 1], "per_step_drafted": [2, 2, 2]}},
}
RECEIVED: list[str] = []  # the prompts the server was sent, in order
RELEASE = threading.Event()  # holds every answer but the first prompt's until the test ends


class Slow(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RECEIVED.append(body["prompt"])
        if body["prompt"] != "p0":
            RELEASE.wait(120)  # (bounded: a client that never hangs up cannot keep the thread)
        data = json.dumps(GOOD).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client hung up: what the interrupt does
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    RECEIVED.clear()
    RELEASE.clear()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    RELEASE.set()
    srv.shutdown()
    srv.server_close()


def _interrupt(_: int) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("concurrency", [1, 3])
def test_an_interrupted_recording_stops_sending_and_leaves_no_responses_file(
    url: str, tmp_path: Path, concurrency: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C left the thread pool to run every prompt not yet sent (its shutdown waits for the queued
    work), each request in flight waited out to its timeout: the recording went on unseen, for hours
    on a long prompt file, and exited only then."""
    prompts = [Prompt(f"p{i}", "default", 8) for i in range(30)]
    out = tmp_path / "t.responses.jsonl"
    done = threading.Event()
    caught: list[BaseException] = []
    posts: list[str] = []  # every request record set out to send (counted before it is sent)
    post = sim.record._post

    def counted(u: str, body: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        posts.append(body["prompt"])
        return post(u, body, *args, **kwargs)

    monkeypatch.setattr(sim.record, "_post", counted)

    def run() -> None:
        try:
            record(
                base_url=url,
                model="m",
                prompts=prompts,
                responses_path=out,
                concurrency=concurrency,
                timeout_s=100,
                on_done=_interrupt,
            )
        except BaseException as e:  # the interrupt, which is what is checked
            caught.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    # (not a timing check: a hang guard, far beyond the answers held back, which the server lets go
    # after 120 s)
    returned = done.wait(60)
    RELEASE.set()
    assert returned, f"record did not return after the interrupt; the server got {len(RECEIVED)} requests"
    assert len(caught) == 1 and isinstance(caught[0], KeyboardInterrupt)
    # Final once record has returned (its workers are gone): p0, those in flight when its answer came,
    # and at most one more per worker taken up meanwhile.
    assert len(posts) <= 2 * concurrency, posts
    assert sorted(p.name for p in tmp_path.iterdir()) == []
