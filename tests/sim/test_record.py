"""``trace record`` against a real HTTP server on loopback that answers like vLLM with detailed metrics."""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

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
