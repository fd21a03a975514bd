"""``trace record`` against a real HTTP server on loopback that answers like vLLM with detailed metrics."""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.arms import Method
from sim.importer import ngram_columns
from sim.record import read_prompts, record_trace
from sim.trace import TraceError, read_trace, write_trace

SEEN: list[dict[str, Any]] = []


class FakeVllm(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN.append(body)
        if body["prompt"] == "boom":
            self.send_response(500)
            self.end_headers()
            return
        # 6 output tokens: prefill gives token 1; step 1 drafts 2 accepts 2 (3 tokens), step 2 drafts 2 accepts 0.
        resp = {
            "id": "cmpl-x",
            "usage": {"prompt_tokens": 5, "completion_tokens": 6},
            "choices": [
                {"text": "......", "prompt_token_ids": [1, 2, 3, 1, 2], "token_ids": [3, 1, 2, 3, 9, 9]}
                if body.get("return_token_ids") and body["prompt"] != "no ids"
                else {"text": "......"}
            ],
            "metrics": {
                "speculative_decoding": {"per_step_accepted": [2, 0, 1], "per_step_drafted": [2, 2, 2]}
            },
        }
        data = json.dumps(resp).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    SEEN.clear()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.integration
def test_record_writes_a_trace_and_counts_failures(server: str, tmp_path: Path) -> None:
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"prompt": "def f():", "class": "code"}\nboom\nhello there\n')
    prompts = read_prompts(prompts_file, default_class="chat", max_tokens=16)
    out = tmp_path / "t.jsonl"
    trace, failures, responses = record_trace(
        base_url=server, model="tiny", prompts=prompts, out=out, method=Method.EAGLE3, concurrency=2
    )
    assert failures == 1 and trace.n == 2 and responses.exists()
    assert sorted(trace.classes) == ["chat", "code"]
    assert {b["vllm_xargs"]["traffic_class"] for b in SEEN} == {"code", "chat"}
    assert all(b["temperature"] == 0.0 and b["model"] == "tiny" for b in SEEN)
    # Steps at positions 0 (accepted 2 of 2: censored at K), 3 (0 of 2), 4 (1 of 2).
    assert trace.acc[Method.EAGLE3][trace.offsets[0] : trace.offsets[1]].tolist() == [2, 1, 0, 0, 1, 0]
    # The n-gram proposal per position, from the token ids (plugin sizes 1..3, capped at max_k 2):
    # the output copies the prompt's 1 2 3 for four positions, then 9 is new, then 9 9 repeats it.
    assert all(b["return_token_ids"] is True for b in SEEN)
    assert trace.ngram_proposal is not None
    assert trace.ngram_proposal[trace.offsets[0] : trace.offsets[1]].tolist() == [2, 2, 2, 2, 0, 1]
    # Greedy: n-gram's counts follow from the token ids whatever drafted, so the trace has them too
    # (the composite drafter's replay needs them; `sim compare --trace` refused the trace without).
    assert trace.methods == (Method.EAGLE3, Method.NGRAM)
    lines = [json.loads(x) for x in responses.read_text().splitlines()]
    by_id = {r["id"]: r["choices"][0] for r in lines if "choices" in r}
    want = [
        ngram_columns(np.array(c["prompt_token_ids"]), np.array(c["token_ids"]), min_n=1, max_n=3, max_k=2)[0]
        for c in (by_id[i] for i in trace.ids)
    ]
    assert trace.acc[Method.NGRAM].tolist() == np.concatenate(want).tolist()
    write_trace(trace, out)
    back = read_trace(out)
    assert back.n == 2 and back.meta["ngram"] == {"min_n": 1, "max_n": 3}
    assert back.ngram_proposal is not None and back.ngram_proposal.tolist() == trace.ngram_proposal.tolist()


@pytest.mark.integration
def test_record_without_token_ids_has_no_proposal(server: str, tmp_path: Path) -> None:
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("hello\nno ids\n")
    prompts = read_prompts(prompts_file, default_class="chat", max_tokens=16)
    trace, failures, _ = record_trace(
        base_url=server, model="tiny", prompts=prompts, out=tmp_path / "t.jsonl", method=Method.NGRAM
    )
    # One response lacks token ids: the proposal is all or none, so none (the counts are vLLM's).
    assert failures == 0 and trace.n == 2 and trace.ngram_proposal is None and "ngram" not in trace.meta
    assert trace.acc[Method.NGRAM][trace.offsets[0] : trace.offsets[1]].tolist() == [2, 1, 0, 0, 1, 0]


def test_token_ids_that_disagree_with_the_usage_name_the_line(tmp_path: Path) -> None:
    from sim.importer import import_vllm_metrics

    good = {
        "usage": {"prompt_tokens": 2, "completion_tokens": 3},
        "choices": [{"prompt_token_ids": [1, 2], "token_ids": [1, 2, 1]}],
        "metrics": {"speculative_decoding": {"per_step_accepted": [1], "per_step_drafted": [2]}},
    }
    bad = json.loads(json.dumps(good))
    bad["choices"][0]["token_ids"] = [1, 2]
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceError) as e:
        import_vllm_metrics(f, method=Method.NGRAM, ngram=(1, 3))
    assert e.value.line == 2 and "choices[0].token_ids" in str(e.value)
    bad["choices"][0]["token_ids"] = [1, -2, 1]
    f.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceError, match=r"token_ids\[1\]"):
        import_vllm_metrics(f, method=Method.NGRAM, ngram=(1, 3))
    # Without ``ngram`` the token ids are not read (the import is as before).
    assert import_vllm_metrics(f, method=Method.NGRAM).ngram_proposal is None


def test_prompt_file_errors_name_the_line(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(TraceError) as e:
        read_prompts(f, default_class="chat", max_tokens=16)
    assert e.value.line == 2 and "prompt" in str(e.value)
    f.write_text('{"prompt": "ok", "max_tokens": 1}\n')
    with pytest.raises(TraceError, match="max_tokens"):
        read_prompts(f, default_class="chat", max_tokens=16)
    f.write_text("\n\n")
    with pytest.raises(TraceError, match="no prompts"):
        read_prompts(f, default_class="chat", max_tokens=16)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (
            '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
            "invalid JSON: a number longer than 4300 digits",
        ),
        ('{"prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested deeper than 32 levels"),
    ],
)
def test_prompt_files_go_through_the_trace_json_loader(tmp_path: Path, line: str, says: str) -> None:
    # Each ended in a traceback (ValueError, RecursionError): read_prompts called json.loads itself.
    f = tmp_path / "p.jsonl"
    f.write_text("plain prompt\n" + line + "\n")
    with pytest.raises(TraceError) as e:
        read_prompts(f, default_class="chat", max_tokens=16)
    assert str(e.value) == f"{f}:2: {says}"


def test_a_server_that_answers_nothing_is_named_with_the_reason(tmp_path: Path) -> None:
    # It said only "rec.responses.jsonl: no responses found", never that every request had failed.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("hello\nthere\n")
    prompts = read_prompts(prompts_file, default_class="chat", max_tokens=4)
    with pytest.raises(TraceError) as e:
        record_trace(
            base_url=f"http://127.0.0.1:{port}", model="m", prompts=prompts, out=tmp_path / "t.jsonl",
            method=Method.EAGLE3,
        )  # fmt: skip
    assert str(e.value).startswith(f"http://127.0.0.1:{port}: every request failed (2); the first: ")
    assert "Connection refused" in str(e.value)


class _CutBody(BaseHTTPRequestHandler):
    """Promises 100 bytes more than it sends, then closes (a proxy that cuts the body)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "102")
        self.end_headers()
        self.wfile.write(b"{}")
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def _not_http_server() -> tuple[str, Any]:
    """Answers every connection with bytes that are not HTTP (as an HTTP/2 or gRPC port would)."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:  # closed: the test is over
                return
            with c:
                c.recv(65536)
                c.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00garbage-not-http\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", srv


@pytest.mark.parametrize("kind", ["not http", "cut body"])
def test_a_server_that_answers_no_whole_http_fails_the_requests_not_the_command(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """BadStatusLine and IncompleteRead (http.client.HTTPException, not OSError) were tracebacks."""
    from sim.cli import main

    if kind == "not http":
        url, srv = _not_http_server()
        stop = srv.close
    else:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _CutBody)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url, stop = f"http://127.0.0.1:{httpd.server_address[1]}", httpd.shutdown
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nthere\n")
    try:
        argv = ["trace", "record", "--url", url, "--model", "m", "--prompts", str(prompts)]
        assert main([*argv, "--out", str(tmp_path / "t.jsonl"), "--max-tokens", "4"]) == 1
    finally:
        stop()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    name = "BadStatusLine" if kind == "not http" else "IncompleteRead"
    assert err.startswith(f"{url}: every request failed (2); the first: not a whole HTTP answer ({name}: ")
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize(
    ("line", "field", "says"),
    [
        ('{"prompt": "x", "class": ""}', "class", 'expected a non-empty string, got ""'),
        ('{"prompt": "x", "class": 3}', "class", "expected a non-empty string, got 3"),
        (
            '{"prompt": "x", "max_tokens": 1}',
            "max_tokens",
            "expected an integer 2..4194304 (as --max-tokens), got 1",
        ),
        (
            '{"prompt": "x", "max_tokens": 4194305}',
            "max_tokens",
            "expected an integer 2..4194304 (as --max-tokens), got 4194305",
        ),
        (
            '{"prompt": "x", "max_tokens": true}',
            "max_tokens",
            "expected an integer 2..4194304 (as --max-tokens), got true",
        ),
    ],
)
def test_prompt_fields_the_importer_or_the_flag_would_refuse_are_refused_before_any_request(
    server: str, tmp_path: Path, line: str, field: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty class was refused by the importer only after every prompt had been sent (exit 1); a huge
    max_tokens was sent as is."""
    from sim.cli import main

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    argv = ["trace", "record", "--url", server, "--model", "m", "--prompts", str(f)]
    assert main([*argv, "--out", str(tmp_path / "t.jsonl")]) == 2
    assert capsys.readouterr().err == f"{f}:2: {field}: {says}\n"
    assert SEEN == [] and not (tmp_path / "t.responses.jsonl").exists()


class _KZeroTail(FakeVllm):
    """Its steps (7 tokens) cover a third of the 20 it made: the rest came at K = 0."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        sd = {"per_step_accepted": [2, 0, 1], "per_step_drafted": [2, 2, 2]}
        resp = {"usage": {"prompt_tokens": 5, "completion_tokens": 20}, "choices": [{"text": body["prompt"]}],
                "metrics": {"speculative_decoding": sd}}  # fmt: skip
        data = json.dumps(resp).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_record_says_what_its_steps_do_not_cover(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The import's warning reaches trace record's stderr (after the progress bar), and the trace is written."""
    from sim.cli import main

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _KZeroTail)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nthere\n")
    out = tmp_path / "t.jsonl"
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert (
            main(
                [
                    "trace",
                    "record",
                    "--url",
                    url,
                    "--model",
                    "m",
                    "--prompts",
                    str(prompts),
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        httpd.shutdown()
    err = capsys.readouterr().err
    assert err == (
        f"{tmp_path / 't.responses.jsonl'}: 2 of 2 responses (26 of 40 output tokens) not covered by their "
        "speculative steps, the first at line 1: K = 0 phases, which vLLM does not report; the trace counts 0 "
        "accepted there and misaligns what follows (record at a fixed K > 0)\n"
    )
    assert read_trace(out).n == 2


@pytest.mark.parametrize("out_name", ["p.jsonl", "p.jsonl.gz", "q.jsonl"])
def test_outputs_naming_the_prompts_are_refused_before_any_request(
    server: str, tmp_path: Path, out_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The prompts were replaced by the trace (``--out`` naming them) or by the responses kept beside it
    (``--prompts q.responses.jsonl --out q.jsonl``) once every prompt had been sent: exit 0, the prompts
    lost."""
    from sim.cli import main

    prompts = tmp_path / ("q.responses.jsonl" if out_name == "q.jsonl" else out_name)
    prompts.write_text("hello\nthere\n")
    out = tmp_path / out_name
    argv = ["trace", "record", "--url", server, "--model", "m", "--prompts", str(prompts), "--out", str(out)]
    assert main(argv) == 2
    named = prompts if out_name == "q.jsonl" else out
    assert capsys.readouterr().err == f"--out {named}: is the --prompts file it reads; name another output\n"
    assert prompts.read_text() == "hello\nthere\n" and SEEN == []


@pytest.mark.parametrize("cls", ["", "\udcff"])
def test_a_class_flag_the_importer_would_refuse_is_refused_before_any_request(
    server: str, tmp_path: Path, cls: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--class ''`` (or one holding a byte that is not UTF-8) is the class of every plain-text prompt:
    every prompt was sent, then the import refused the responses file's first line (exit 1)."""
    from sim.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    argv = ["trace", "record", "--url", server, "--model", "m", "--prompts", str(prompts), "--class", cls]
    assert main([*argv, "--out", str(tmp_path / "t.jsonl")]) == 2
    assert capsys.readouterr().err == f"--class: expected a non-empty string, got {json.dumps(cls)}\n"
    assert SEEN == [] and not (tmp_path / "t.responses.jsonl").exists()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cls=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20))
def test_a_prompts_traffic_class_key_is_its_class(tmp_path: Path, cls: str) -> None:
    """The key the request carries it under (``vllm_xargs.traffic_class``), which the importer takes as
    well as ``class``, was ignored: every such prompt was recorded as class ``default``, unsaid."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "x", "traffic_class": cls}) + "\n", encoding="utf-8")
    assert read_prompts(f, default_class="default", max_tokens=8)[0].traffic_class == cls
    f.write_text(
        json.dumps({"prompt": "x", "traffic_class": cls, "class": cls + "2"}) + "\n", encoding="utf-8"
    )
    with pytest.raises(TraceError, match=r"p\.jsonl:1: class: .*but traffic_class is .*: give one of them"):
        read_prompts(f, default_class="default", max_tokens=8)
