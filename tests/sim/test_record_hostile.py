"""``trace record`` against servers that misbehave: every failure is one line naming the request, memory and
time stay bounded, and no responses file is left that reads as a whole recording. An answer the import
would refuse, or a redirect, fails its request only; answers of another model, or some without token
ids, are kept and said in one line."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import sim.record as record_module
from sim.cli import main
from sim.record import STOP_AFTER_CONNECT_FAILURES

GOOD = {
    "usage": {"prompt_tokens": 5, "completion_tokens": 6},
    "choices": [{"text": "......", "prompt_token_ids": [1, 2, 3, 1, 2], "token_ids": [3, 1, 2, 3, 9, 9]}],
    "metrics": {"speculative_decoding": {"per_step_accepted": [2, 0, 1], "per_step_drafted": [2, 2, 2]}},
}
MODE: dict[str, str] = {"mode": "good"}
BAD: dict[str, Any] = {}  # mode "bad-second": the answer to the prompt "two"


class Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, data: bytes, code: int = 200, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, head: bytes, chunk: bytes, ctype: str, pause: float) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(head)
            for _ in range(100_000):  # bounded, so a broken client cannot keep the test's thread
                self.wfile.write(chunk)
                self.wfile.flush()
                time.sleep(pause)
        except OSError:
            pass
        self.close_connection = True

    def _drip_raw(self, data: bytes, pause: float) -> None:
        """``data`` (status line and headers included) a byte at a time."""
        try:
            for b in data:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(pause)
        except OSError:
            pass
        self.close_connection = True

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = MODE["mode"]
        if mode == "half" and body["prompt"] == "good":
            mode = "good"
        if mode.startswith("redirect-"):
            self.send_response(int(mode.removeprefix("redirect-")))
            self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if mode == "other-model":
            self._send(json.dumps({**GOOD, "model": "llama-70b"}).encode())
            return
        if mode == "bad-second":
            self._send(json.dumps(BAD["answer"] if body["prompt"] == "two" else GOOD).encode())
            return
        if mode in ("good", "half"):
            self._send(json.dumps(GOOD).encode() if mode == "good" else b"<html>busy</html>")
        elif mode == "500":
            self._send(b'{"message": "model not\\nloaded"}', code=500)
        elif mode == "nan":
            self._send(json.dumps({**GOOD, "x": float("nan")}).encode())
        elif mode == "endless":
            self._stream(b'{"pad": "', b"x" * 65536, "application/json", 0)
        elif mode == "sse":
            self._stream(b"", b"data: {}\n\n", "text/event-stream", 0.01)
        elif mode == "drip":
            self._stream(b"{", b" ", "application/json", 0.2)
        elif mode == "drip-head":  # 200 header bytes: 40 s
            self._drip_raw(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"x" * 180 + b"\r\n\r\n", 0.2)
        elif mode == "slow":  # the whole answer in about 1 s, a wait between each of its 40-odd pieces
            data = json.dumps(GOOD).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            self._drip_raw(head.encode() + data, 0.003)

    def do_GET(self) -> None:  # what a redirect's target answers: a response, for no prompt
        self._send(json.dumps(GOOD).encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    MODE["mode"] = "good"
    srv.shutdown()
    srv.server_close()


def _record(url: str, tmp_path: Path, *extra: str, prompts: str = "hello\nthere\n") -> int:
    f = tmp_path / "p.txt"
    f.write_text(prompts)
    argv = ["trace", "record", "--url", url, "--model", "m", "--prompts", str(f), "--max-tokens", "8"]
    return main([*argv, "--out", str(tmp_path / "t.jsonl"), *extra])


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        # The body was read whole: gigabytes of memory until killed.
        ("endless", "the answer is over 67104768 bytes"),
        # A stream or a drip never hit the socket timeout, which bounds one wait: the command hung.
        ("sse", "the server streamed (text/event-stream); expected one JSON answer"),
        ("drip", "no whole answer within the timeout (1 s)"),
        # Status line and headers a byte at a time: each wait was bounded, not the request (40 s, then
        # "no whole answer within the timeout (0 bytes read)").
        ("drip-head", "no whole answer within the timeout (1 s)"),
        # NaN was kept in the responses file, which then was not JSON.
        ("nan", "not JSON: NaN (not a JSON number)"),
        # Only "HTTP Error 500: Internal Server Error": not vLLM's reason.
        ("500", 'HTTP 500 Internal Server Error: {"message": "model not\\nloaded"}'),
    ],
)
def test_a_hostile_answer_fails_its_request_in_one_line_naming_it(
    url: str, tmp_path: Path, mode: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    MODE["mode"] = mode
    t0 = time.monotonic()
    assert _record(url, tmp_path, "--timeout", "1") == 1
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert says in err[0], err[0]
    assert f"(POST {url}/v1/completions for prompt {tmp_path / 'p.txt'}:1)" in err[0]
    # Every request failed: not even an empty responses file (one was left, 0 bytes) and no trace.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]


def test_a_slow_answer_within_the_timeout_is_recorded(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The deadline bounds the request, not each wait: an answer dripped whole in time is kept, and no
    deadline's timer outlives its request."""
    MODE["mode"] = "slow"
    assert _record(url, tmp_path, "--timeout", "30") == 0
    assert "failed" not in capsys.readouterr().err
    assert len((tmp_path / "t.responses.jsonl").read_text().splitlines()) == 2
    assert not [t for t in threading.enumerate() if isinstance(t, threading.Timer)]


def test_some_failed_requests_are_said_once_with_the_first_reason(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only "(1 failed)" in the summary: why was never said."""
    MODE["mode"] = "half"
    assert _record(url, tmp_path, prompts="good\nbad\n") == 0
    err = capsys.readouterr().err
    assert f"{url}: 1 of 2 requests failed; the first: not JSON (Expecting value: byte 0 of 17)" in err
    assert (tmp_path / "t.jsonl").exists() and (tmp_path / "t.responses.jsonl").exists()
    assert not (tmp_path / "t.responses.jsonl.partial").exists()


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("notaurl", "expected http://HOST[:PORT] or https://HOST[:PORT]"),
        ("ftp://x", "expected http://HOST[:PORT] or https://HOST[:PORT]"),
        ("http://[::1", "not a URL (Invalid IPv6 URL)"),
        ("http://127.0.0.1:99999", "not a URL (Port out of range 0-65535)"),
        ("http://127.0.0.1:0", "port 0 names no server"),
    ],
)
def test_a_url_that_names_no_server_is_a_usage_error_before_any_request(
    tmp_path: Path, given: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each failed every request one by one, then exited 1 as if the server were down."""
    assert _record(given, tmp_path) == 2
    assert capsys.readouterr().err.strip().startswith(f"--url {given}: {says}")


def test_a_responses_file_that_cannot_be_written_is_refused_before_any_request(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory of its name failed after every request was sent, as a bare errno (exit 1)."""
    (tmp_path / "t.responses.jsonl").mkdir()
    assert _record(url, tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"--out {tmp_path / 't.responses.jsonl'}: is a directory, not a file (the responses kept beside the trace)"
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to fail a write")
def test_a_full_disk_is_one_runtime_error_and_leaves_no_partial_file(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "error: errorNo space left on device"."""
    (tmp_path / "t.responses.jsonl.partial").symlink_to("/dev/full")
    assert _record(url, tmp_path) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith(": cannot write the responses: No space left on device"), err
    assert not (tmp_path / "t.responses.jsonl").exists() and not (tmp_path / "t.jsonl").exists()


# -- answers that are JSON objects, but no response the trace can take ------------------------------


def _bad_answer(case: str) -> dict[str, Any]:
    bad: dict[str, Any] = json.loads(json.dumps(GOOD))
    sd = bad["metrics"]["speculative_decoding"]
    if case == "no usage":
        del bad["usage"]
    elif case == "negative tokens":
        bad["usage"]["completion_tokens"] = -3
    elif case == "float tokens":
        bad["usage"]["completion_tokens"] = 6.5
    elif case == "string tokens":
        bad["usage"]["prompt_tokens"] = "5"
    elif case == "huge tokens":
        bad["usage"]["completion_tokens"] = 2**63
    elif case == "no metrics":
        del bad["metrics"]
    elif case == "accepted over drafted":
        sd["per_step_accepted"] = [3, 0, 1]
    elif case == "token ids short":
        bad["choices"][0]["token_ids"] = [3, 1]
    return bad


BAD_ANSWERS = {
    "no usage": "usage: missing",
    "negative tokens": "usage.completion_tokens: expected an integer 1..4194304, got -3",
    "float tokens": "usage.completion_tokens: expected an integer 1..4194304, got 6.5",
    "string tokens": "usage.prompt_tokens: expected an integer 0..16777216, got '5'",
    "huge tokens": "usage.completion_tokens: expected an integer 1..4194304, got 9223372036854775808",
    "no metrics": "metrics.speculative_decoding: missing",
    "accepted over drafted": "per_step_accepted[0]: 3 accepted of 2 drafted",
    "token ids short": "choices[0].token_ids: 2 token ids, but usage.completion_tokens is 6",
}


@pytest.mark.parametrize("case", sorted(BAD_ANSWERS))
def test_an_answer_the_trace_cannot_take_fails_its_request_not_the_recording(
    url: str, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One such answer among good ones failed the whole recording after every request (exit 1, no
    trace), the error naming a line of the responses file rather than the request."""
    MODE["mode"] = "bad-second"
    BAD["answer"] = _bad_answer(case)
    assert _record(url, tmp_path, prompts="one\ntwo\nthree\n") == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"{url}: 1 of 3 requests failed; the first: "), err[0]
    assert BAD_ANSWERS[case] in err[0], err[0]
    assert err[0].endswith(f"(POST {url}/v1/completions for prompt {tmp_path / 'p.txt'}:2)"), err[0]
    lines = (tmp_path / "t.responses.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["r0", "r2"]  # kept: the good ones only
    assert (tmp_path / "t.jsonl").exists()


def test_answers_from_another_model_are_said(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server (a router, a proxy) answering for a model other than --model was recorded without a
    word: the trace held that model's acceptance under the name asked for."""
    MODE["mode"] = "other-model"
    assert _record(url, tmp_path, prompts="one\ntwo\n") == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"{url}: 2 of 2 responses name the model 'llama-70b', not --model 'm'"), err[0]
    assert f"the first for prompt {tmp_path / 'p.txt'}:1" in err[0]


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_fails_the_request_saying_where_it_pointed(
    url: str, tmp_path: Path, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """urllib follows a 301, 302 or 303 to a POST with a GET without the prompt: whatever answered
    that GET (here a well-formed response) was recorded as the prompt's response, exit 0."""
    MODE["mode"] = f"redirect-{code}"
    assert _record(url, tmp_path) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert f"HTTP {code} " in err[0] and "redirected to /elsewhere, not followed" in err[0], err[0]
    assert "give --url of the server itself" in err[0], err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]


def test_some_answers_without_token_ids_are_said(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One answer without token ids (of answers that have them) dropped the n-gram signal and counts
    from the whole trace, and the summary said "the server returned no token ids"."""
    MODE["mode"] = "bad-second"
    BAD["answer"] = {**GOOD, "choices": [{"text": "......"}]}
    assert _record(url, tmp_path, prompts="one\ntwo\nthree\n") == 0
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    responses = tmp_path / "t.responses.jsonl"
    assert err[0] == (
        f"{responses}: 1 of 3 responses carry no token ids (choices[0].token_ids, prompt_token_ids), the "
        f"first at line 2: the trace has no n-gram proposals or counts from them"
    ), err[0]
    assert "no n-gram proposals: responses without token ids" in captured.out


# -- a server that goes away ------------------------------------------------------------------------


@pytest.fixture
def dies_after_three() -> Iterator[str]:
    """A server that answers three requests, one connection each, then stops listening (it died)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            for n in range(3):
                conn, _ = listener.accept()
                if n == 2:
                    listener.close()  # later connections are refused; this one is answered
                with conn:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        head += conn.recv(65536)
                    head, _, body = head.partition(b"\r\n\r\n")
                    size = int(next(v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                                    if k.lower() == b"content-length"))  # fmt: skip
                    while len(body) < size:
                        body += conn.recv(65536)
                    data = json.dumps(GOOD).encode()
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                        + f"Content-Length: {len(data)}\r\n\r\n".encode()
                        + data
                    )

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{port}"
    t.join(5)


def _not_sent(said: str, tail: str) -> int:
    """N of "...; N of M prompts not sent<tail>"."""
    assert said.endswith(f" prompts not sent{tail}"), said
    return int(said.removesuffix(f" prompts not sent{tail}").rsplit("; ", 1)[1].split(" of ")[0])


def test_a_server_that_dies_partway_stops_the_recording_exit_1_keeping_what_it_answered(
    dies_after_three: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every prompt left was sent to the dead server, each refused, and the run ended as if whole:
    exit 0, the trace of the first three, "(37 failed)" in its summary."""
    prompts = "".join(f"p{i}\n" for i in range(40))
    assert _record(dies_after_three, tmp_path, "--concurrency", "1", prompts=prompts) == 1
    captured = capsys.readouterr()
    assert "wrote " in captured.out and ": 3 requests (37 failed)" in captured.out, captured.out
    err = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err
    assert err[-1].startswith(
        f"{dies_after_three}: stopped after {STOP_AFTER_CONNECT_FAILURES} connections in a row could not be "
        "opened (the last: Connection refused (POST "
    ), err[-1]
    # (the one worker may have taken up the next prompt before the stop: it is cut, not answered)
    assert _not_sent(err[-1], "; the trace holds the 3 requests answered before") in (28, 29), err[-1]
    lines = (tmp_path / "t.responses.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["r0", "r1", "r2"]


def test_a_server_that_dies_under_a_realistic_load_stops_the_recording_too(
    dies_after_three: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same at 32 requests in flight and 500 prompts: the connections queued when the server died
    end reset (they were opened), the next ones are refused, and the stop still comes within a few
    batches of requests, not after all 500."""
    prompts = "".join(f"p{i}\n" for i in range(500))
    assert _record(dies_after_three, tmp_path, "--concurrency", "32", prompts=prompts) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert ": 3 requests (497 failed)" in captured.out, captured.out
    said = captured.err.strip().splitlines()[-1]
    assert f"stopped after {STOP_AFTER_CONNECT_FAILURES} connections in a row could not be opened" in said, (
        said
    )
    # At most the requests in flight at the death and at the stop, and the refused ones, were sent.
    assert _not_sent(said, "; the trace holds the 3 requests answered before") >= 500 - 3 - 8 - 2 * 32, said


def test_a_host_that_drops_connections_is_given_up_on_not_waited_out_per_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A listener whose queue is full drops the connections asked of it, as a firewall does: each
    request waited its whole --timeout (10 minutes by default) for its connection, prompt after
    prompt."""
    monkeypatch.setattr(record_module, "CONNECT_TIMEOUT_S", 0.3)
    with socket.create_server(("127.0.0.1", 0), backlog=0) as listener:
        port = listener.getsockname()[1]
        queued = [socket.socket() for _ in range(4)]  # fill its queue: connections past it are dropped
        for s in queued:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
        try:
            prompts = "".join(f"p{i}\n" for i in range(10))
            url = f"http://127.0.0.1:{port}"
            assert _record(url, tmp_path, "--concurrency", "1", "--timeout", "5", prompts=prompts) == 1
        finally:
            for s in queued:
                s.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(
        f"{url}: no request was answered: stopped after {STOP_AFTER_CONNECT_FAILURES} connections in a "
        "row could not be opened (the last: no connection within 0.3 s (POST "
    ), err[0]
    assert _not_sent(err[0], "") in (1, 2), err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]


class _Hangs(Hostile):
    """Reads the request; answers it when ``answer(n)`` says so for the n-th request (from 0), else
    holds it without a byte until the server closes (a hung server)."""

    answer: Any = staticmethod(lambda n: False)
    count = 0
    lock = threading.Lock()
    released = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            n, type(self).count = type(self).count, type(self).count + 1
        if not type(self).answer(n):
            self.released.wait(60)
            return
        self._send(json.dumps(GOOD).encode())


def _hanging_server(answer: Any) -> Iterator[str]:
    handler: type[_Hangs] = type("Handler", (_Hangs,), {"answer": staticmethod(answer), "count": 0,
                                          "released": threading.Event()})  # fmt: skip
    # (a listen queue for every request in flight: past the default 5, answerable requests waited
    # in it behind the hung ones and timed out too)
    srv = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 64})(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        handler.released.set()
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def never_answers() -> Iterator[str]:
    yield from _hanging_server(lambda n: False)


@pytest.fixture
def answers_every_other() -> Iterator[str]:
    yield from _hanging_server(lambda n: n % 2 == 0)


def test_a_server_that_never_answers_stops_the_recording_after_a_row_of_timeouts(
    never_answers: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Connections accepted, nothing answered: every prompt waited its whole --timeout (10 minutes by
    default), 32 at a time, so 500 prompts failed after hours."""
    prompts = "".join(f"p{i}\n" for i in range(500))
    assert _record(never_answers, tmp_path, "--concurrency", "32", "--timeout", "1", prompts=prompts) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(
        f"{never_answers}: no request was answered: stopped after {record_module.STOP_AFTER_TIMEOUTS} "
        "requests in a row timed out (the last: no whole answer within the timeout (1 s) (POST "
    ), err[0]
    # The first 32 were sent; the stop came as they timed out, so the other 468 were not.
    assert _not_sent(err[0], "") >= 500 - 2 * 32, err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt"]


def test_timeouts_with_answers_between_them_do_not_stop_the_recording(
    answers_every_other: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that answers some requests is there: every prompt is sent, the timed-out ones fail."""
    prompts = "".join(f"p{i}\n" for i in range(20))
    assert (
        _record(answers_every_other, tmp_path, "--concurrency", "1", "--timeout", "0.3", prompts=prompts) == 0
    )
    captured = capsys.readouterr()
    assert ": 10 requests (10 failed)" in captured.out, captured.out
    assert "stopped" not in captured.err, captured.err


def test_timeouts_among_answers_at_32_in_flight_do_not_stop_the_recording(
    answers_every_other: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In flight together, the hung requests time out together, after the answers that came while they
    waited: counted in the order they ended, 8 of them made a row and stopped a server that answers."""
    prompts = "".join(f"p{i}\n" for i in range(200))
    args = ("--concurrency", "32", "--timeout", "0.5")
    assert _record(answers_every_other, tmp_path, *args, prompts=prompts) == 0
    captured = capsys.readouterr()
    assert ": 100 requests (100 failed)" in captured.out, captured.out
    assert "stopped" not in captured.err, captured.err


def test_the_help_and_the_docs_give_the_limits_the_code_has(capsys: pytest.CaptureFixture[str]) -> None:
    """The connect limit and the stop are written out in ``--timeout``'s help and in docs/spectrace.md."""
    with pytest.raises(SystemExit):
        main(["trace", "record", "--help"])
    shown_help = " ".join(capsys.readouterr().out.split())
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "spectrace.md").read_text().split())
    for text in (shown_help, docs):
        assert f"within {record_module.CONNECT_TIMEOUT_S:g} s" in text
        assert f"{STOP_AFTER_CONNECT_FAILURES} connections in a row" in text
        assert f"{record_module.STOP_AFTER_TIMEOUTS} requests in a row timed out" in text
