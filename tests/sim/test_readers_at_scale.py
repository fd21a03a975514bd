"""The simulator's file readers at realistic sizes and edges: the same results as a plain reading,
memory proportional to what they keep, and edge bytes (a BOM, CRLF, blank lines, no final newline)
read or refused as one clear FILE:LINE error.

Memory bounds here are generous (1.6x what the reader keeps, plus a constant) and the old readers broke
them 2-4x over; they are tracemalloc peaks, not timings."""

from __future__ import annotations

import gzip
import json
import random
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import Method
from sim import steplog
from sim.importer import NGRAM_HORIZON, import_token_ids, import_vllm_metrics, ngram_columns
from sim.record import read_prompts, record_trace
from sim.steplog import StepLog, StepLogError, parse_step, read_steps
from sim.trace import Trace, TraceError, load_json_line, read_json_lines, read_trace, validate_trace

_METHODS = ["eagle3", "ngram", "off", "p_eagle"]


def _peak(f: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        out = f()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- step logs (profile fit STEPS) ----------------------------------------------------------------


def _step_lines(n: int, seed: int, *, kv: str = "null") -> list[str]:
    """``n`` recorded steps: batches up to 32, every method, three engines; ``kv``: null, all, some."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        b = r.randint(0, 32)
        meth = [r.choice(_METHODS) for _ in range(b)]
        k = [0 if m == "off" else r.randint(1, 64) for m in meth]
        d: dict[str, Any] = {
            "engine": f"pod-{i % 3}",
            "time_s": i * 0.01 + r.random(),
            "duration_s": 2e-6 + r.random() * 0.05,  # (at least 50 ns per request of the batch)
            "batch": b + r.randint(0, 2),
            "prefill_tokens": r.choice([0, 0, 512, 1 << 22]),
            "decoded_tokens": r.randint(0, 1 << 42),
            "method": meth,
            "k": k,
            "accepted": [r.randint(0, x) for x in k],
        }
        if kv == "all" or (kv == "some" and i % 5):
            d["kv_tokens"] = r.randint(0, 1 << 42)
        elif kv == "null":
            d["kv_tokens"] = None
        out.append(json.dumps(d, separators=(",", ":")))
    return out


def _plain_read(path: Path) -> StepLog:
    """The reader as it was (Python lists, one dict a step): the reference the chunked one must equal."""
    steps: list[dict[str, Any]] = []
    g: list[int] = []
    method: list[int] = []
    k: list[int] = []
    acc: list[int] = []
    for ln, line in read_json_lines(path):
        fields, codes, ks, a = parse_step(load_json_line(line, source=str(path), line=ln), f"{path}:{ln}")
        g.extend([len(steps)] * len(codes))
        steps.append(fields)
        method.extend(codes)
        k.extend(ks)
        acc.extend(a)
    kv = [s["kv_tokens"] for s in steps]
    return StepLog(
        source=str(path),
        engine=tuple(s["engine"] for s in steps),
        duration_s=np.array([s["duration_s"] for s in steps], dtype=np.float64),
        batch=np.array([s["batch"] for s in steps], dtype=np.int64),
        prefill_tokens=np.array([s["prefill_tokens"] for s in steps], dtype=np.int64),
        kv_tokens=None if any(x is None for x in kv) else np.array(kv, dtype=np.float64),
        decoded_tokens=np.array([s["decoded_tokens"] for s in steps], dtype=np.float64),
        time_s=np.array([s["time_s"] for s in steps], dtype=np.float64),
        row_step=np.array(g, dtype=np.int64),
        method=np.array(method, dtype=np.int8),
        k=np.array(k, dtype=np.int64),
        accepted=np.array(acc, dtype=np.int64),
    )


def _assert_same(a: Any, b: Any) -> None:
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray), f
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), f
        elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), np.ndarray):
            assert list(x) == list(y), f
            for m in x:
                assert x[m].dtype == y[m].dtype and np.array_equal(x[m], y[m]), (f, m)
        else:
            assert x == y, f


@pytest.mark.parametrize("kv", ["null", "all", "some", "absent"])
def test_step_log_of_thousands_of_steps_reads_as_the_plain_reading(
    tmp_path: Path, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = _step_lines(3000, seed=len(kv), kv=kv)
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(lines) + "\n")
    want = _plain_read(path)
    _assert_same(read_steps(path), want)
    monkeypatch.setattr(steplog._Column, "CHUNK", 7)  # every chunk boundary crossed, mid-step too
    _assert_same(read_steps(path), want)
    gz = tmp_path / "steps.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_steps(gz).k.tolist() == want.k.tolist()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    seed=st.integers(0, 10**6),
    chunk=st.integers(1, 50),
    kv=st.sampled_from(["null", "all", "some", "absent"]),
    crlf=st.booleans(),
    final_newline=st.booleans(),
    blanks=st.integers(0, 3),
)
def test_step_logs_of_any_shape_read_as_the_plain_reading(
    tmp_path_factory: pytest.TempPathFactory,
    n: int,
    seed: int,
    chunk: int,
    kv: str,
    crlf: bool,
    final_newline: bool,
    blanks: int,
) -> None:
    eol = "\r\n" if crlf else "\n"
    lines = _step_lines(n, seed, kv=kv)
    text = (eol + (" \t" + eol) * blanks).join(lines) + (eol if final_newline else "")
    path = tmp_path_factory.mktemp("s") / "steps.jsonl"
    path.write_text(text, newline="")
    old = steplog._Column.CHUNK
    steplog._Column.CHUNK = chunk
    try:
        _assert_same(read_steps(path), _plain_read(path))
    finally:
        steplog._Column.CHUNK = old


def test_step_log_memory_is_what_it_keeps(tmp_path: Path) -> None:
    """20k steps, 330k request rows (7 MB): the list reader peaked at 3.3x the arrays it returned."""
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(_step_lines(20_000, seed=1)) + "\n")
    log, peak = _peak(lambda: read_steps(path))
    cols = ("duration_s", "batch", "prefill_tokens", "decoded_tokens", "time_s", "row_step", "method", "k")
    kept = sum(getattr(log, f).nbytes for f in (*cols, "accepted"))
    kept += 8 * log.n  # the engine tuple's references
    assert len(log.k) > 300_000
    assert peak < 1.6 * kept + (2 << 20), (peak, kept)


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (
            lambda d: d.update(k=[2**63, *d["k"][1:]]),
            "k[0]: expected an integer 0..64, got 9223372036854775808",
        ),
        (lambda d: d.update(batch=-1), "batch: expected an integer 0..1048576, got -1"),
        (lambda d: d.update(prefill_tokens=1.0), "prefill_tokens: expected an integer 0..4194304, got 1.0"),
        (lambda d: d.update(decoded_tokens=2**63), "decoded_tokens: expected an integer 0..4398046511104"),
    ],
)
def test_a_bad_step_far_into_a_big_log_names_its_line_and_field(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], where: str
) -> None:
    lines = _step_lines(5000, seed=3)
    d = json.loads(lines[4321])
    d["method"], d["k"], d["accepted"], d["batch"] = ["eagle3"], [3], [1], 4
    edit(d)
    lines[4321] = json.dumps(d)
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(StepLogError) as e:
        read_steps(path)
    assert str(e.value).startswith(f"{path}:4322: {where}")


# -- spectrace files (sim replay --trace, trace validate) -------------------------------------------


def _trace_lines(n: int, seed: int, *, alpha: bool = False, proposal: bool = True) -> list[str]:
    r = random.Random(seed)
    lines = [
        json.dumps(
            {
                "spectrace": 1,
                "max_k": 8,
                "methods": ["eagle3", "p_eagle", "ngram"],
                "meta": {"ngram": {"min_n": 1, "max_n": 3}},
            }
        )
    ]
    for i in range(n):
        out = r.randint(1, 3000)
        prop = [r.randint(0, 8) for _ in range(out)]
        acc: dict[str, Any] = {
            "eagle3": [r.randint(0, 20) for _ in range(out)],
            "p_eagle": {"alpha": [r.random() for _ in range(8)]}
            if alpha
            else [r.randint(0, 20) for _ in range(out)],
            "ngram": [min(p, r.randint(0, 9)) if p < 8 else r.randint(0, 30) for p in prop],
        }
        rec: dict[str, Any] = {
            "id": f"r{i}",
            "class": r.choice(["chat", "code"]),
            "arrival_s": i * 0.5,
            "prompt_tokens": r.randint(0, 4000),
            "output_tokens": out,
            "acc": acc,
        }
        if proposal:
            rec["ngram_proposal"] = prop
        lines.append(json.dumps(rec, separators=(",", ":")))
    return lines


def test_a_trace_reads_in_memory_near_its_arrays(tmp_path: Path) -> None:
    """800 requests, 4.8 million positions and methods: the reader held each as a Python list entry
    (8 bytes) next to the int32 arrays, and concatenated with a copy: a 3.9x peak."""
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(_trace_lines(800, seed=5)) + "\n").encode(), 1))
    t, peak = _peak(lambda: read_trace(path))
    assert isinstance(t, Trace) and t.ngram_proposal is not None
    kept = sum(a.nbytes for a in t.acc.values()) + t.ngram_proposal.nbytes
    assert kept > 4 << 20
    assert peak < 1.6 * kept + (2 << 20), (peak, kept)
    errors, peak = _peak(lambda: validate_trace(path))
    assert errors == [] and peak < 0.5 * kept, peak  # a validation keeps no positions at all


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), alpha=st.booleans(), proposal=st.booleans(), n=st.integers(1, 6))
def test_trace_columns_are_the_file_s_numbers(
    tmp_path_factory: pytest.TempPathFactory, seed: int, alpha: bool, proposal: bool, n: int
) -> None:
    """What the reader returns against the file read plainly, alpha draws included (their seeded
    sampling is capped by the proposal as before)."""
    lines = _trace_lines(n, seed, alpha=alpha, proposal=proposal)
    path = tmp_path_factory.mktemp("t") / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    t = read_trace(path, seed=seed)
    reqs = [json.loads(x) for x in lines[1:]]
    for m in ("eagle3", "ngram") + (() if alpha else ("p_eagle",)):
        want = np.concatenate([np.array(q["acc"][m], dtype=np.int32) for q in reqs])
        assert t.acc[Method(m)].dtype == np.int32 and np.array_equal(t.acc[Method(m)], want)
    if proposal:
        want = np.concatenate([np.array(q["ngram_proposal"], dtype=np.int32) for q in reqs])
        assert t.ngram_proposal is not None and np.array_equal(t.ngram_proposal, want)
    else:
        assert t.ngram_proposal is None
    again = read_trace(path, seed=seed)
    _assert_same(t, again)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (2**63, "acc.eagle3[1]: must be an integer 0..2147483647, got 9223372036854775808"),
        (-1, "acc.eagle3[1]: must be an integer 0..2147483647, got -1"),
        (1.0, "acc.eagle3[1]: must be an integer 0..2147483647, got 1.0"),
        (True, "acc.eagle3[1]: must be an integer 0..2147483647, got True"),
        (None, "acc.eagle3[1]: must be an integer 0..2147483647, got None"),
    ],
)
def test_a_count_at_a_type_edge_is_named(tmp_path: Path, value: Any, message: str) -> None:
    lines = _trace_lines(3, seed=1, proposal=False)
    q = json.loads(lines[2])
    q["acc"]["eagle3"][1] = value
    lines[2] = json.dumps(q)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert str(e.value) == f"{path}:3: {message}"


# -- imports (trace import, trace import --tokens) -------------------------------------------------


def _responses(n: int, seed: int, *, out_len: int = 1500, prompt_len: int = 1500) -> list[str]:
    r = random.Random(seed)
    lines = []
    for i in range(n):
        o = [r.randrange(50) for _ in range(out_len)]
        pa: list[int] = []
        pd: list[int] = []
        done = 1
        while done < out_len:
            k = r.randint(1, 6)
            a = r.randint(0, k)
            pa.append(a)
            pd.append(k)
            done += a + 1
        lines.append(
            json.dumps(
                {
                    "id": f"r{i}",
                    "traffic_class": "code",
                    "arrival_s": i * 0.1,
                    "usage": {"prompt_tokens": prompt_len, "completion_tokens": out_len},
                    "choices": [
                        {"prompt_token_ids": [r.randrange(50) for _ in range(prompt_len)], "token_ids": o}
                    ],
                    "metrics": {"speculative_decoding": {"per_step_accepted": pa, "per_step_drafted": pd}},
                }
            )
        )
    return lines


def test_a_vllm_import_keeps_no_token_ids(tmp_path: Path) -> None:
    """60 responses of 6k-token prompts and 1.5k-token outputs: every response's token ids were held
    (int64) to the end, 3x the imported columns."""
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(_responses(60, seed=1, out_len=1500, prompt_len=6000)) + "\n")
    t, peak = _peak(lambda: import_vllm_metrics(path, ngram=(1, 3), greedy=True))
    assert isinstance(t, Trace) and t.ngram_proposal is not None
    kept = sum(a.nbytes for a in t.acc.values()) + t.ngram_proposal.nbytes
    assert peak < 1.6 * kept + (2 << 20), (peak, kept)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), lo=st.integers(1, 3), span=st.integers(0, 3), greedy=st.booleans())
def test_a_vllm_import_s_ngram_columns_are_the_matcher_s_at_the_trace_s_max_k(
    tmp_path_factory: pytest.TempPathFactory, seed: int, lo: int, span: int, greedy: bool
) -> None:
    """The proposal is min(draft, max_k) for the max_k of the whole file (known only at its end)."""
    lines = _responses(4, seed, out_len=200, prompt_len=50)
    path = tmp_path_factory.mktemp("r") / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    method = Method.NGRAM if seed % 2 else Method.EAGLE3
    t = import_vllm_metrics(path, ngram=(lo, lo + span), greedy=greedy, method=method)
    objs = [json.loads(x) for x in lines]
    max_k = max(max(o["metrics"]["speculative_decoding"]["per_step_drafted"]) for o in objs)
    cols = [
        ngram_columns(
            np.array(o["choices"][0]["prompt_token_ids"]),
            np.array(o["choices"][0]["token_ids"]),
            min_n=lo,
            max_n=lo + span,
            max_k=max_k,
        )
        for o in objs
    ]
    assert t.max_k == max_k and t.ngram_proposal is not None
    assert np.array_equal(t.ngram_proposal, np.concatenate([p for _, p in cols]))
    if method is Method.NGRAM or greedy:
        assert np.array_equal(t.acc[Method.NGRAM], np.concatenate([a for a, _ in cols]))


def test_a_response_without_token_ids_leaves_the_proposal_out_and_later_lines_checked(tmp_path: Path) -> None:
    lines = _responses(3, seed=2, out_len=50, prompt_len=10)
    q = json.loads(lines[0])
    del q["choices"][0]["token_ids"]
    lines[0] = json.dumps(q)
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert import_vllm_metrics(path, ngram=(1, 3)).ngram_proposal is None
    q = json.loads(lines[2])
    q["choices"][0]["token_ids"][7] = 2**63
    lines[2] = json.dumps(q)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as e:
        import_vllm_metrics(path, ngram=(1, 3))
    assert str(e.value) == (
        f"{path}:3: choices[0].token_ids[7]: must be a token id 0..2147483647, got 9223372036854775808"
    )


@pytest.mark.parametrize("value", [2**63, -1, 3.0, True, "7"])
def test_a_token_id_at_a_type_edge_is_named(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "tok.jsonl"
    ids = list(range(40))
    ids[33] = value
    path.write_text(
        json.dumps({"prompt_token_ids": [1, 2], "output_token_ids": list(range(40))})
        + "\r\n\r\n"
        + json.dumps({"prompt_token_ids": [1, 2], "output_token_ids": ids})
    )
    with pytest.raises(TraceError) as e:
        import_token_ids(path)
    assert str(e.value) == f"{path}:3: output_token_ids[33]: must be a token id 0..2147483647, got {value!r}"


def test_token_ids_import_reads_crlf_blank_lines_and_no_final_newline(tmp_path: Path) -> None:
    rows = [
        {"id": f"q{i}", "prompt_token_ids": [1, 2, 3] * 5, "output_token_ids": [1, 2, 3, 4] * 10}
        for i in range(3)
    ]
    path = tmp_path / "tok.jsonl"
    path.write_bytes(
        b"\r\n".join(json.dumps(r).encode() for r in rows[:2])
        + b"\r\n\r\n  \r\n"
        + json.dumps(rows[2]).encode()
    )
    t = import_token_ids(path, min_n=1, max_n=3)
    assert t.ids == ("q0", "q1", "q2") and t.total_output_tokens == 120
    horizon = min(NGRAM_HORIZON, 8)
    assert int(t.ngram_proposal.max()) == horizon  # type: ignore[union-attr]


# -- trace record: prompts and responses ---------------------------------------------------------


def test_a_prompts_file_with_a_byte_order_mark_reads_its_first_line_as_json(tmp_path: Path) -> None:
    """Saved by Notepad or PowerShell: the first JSON line was sent whole as a plain-text prompt."""
    path = tmp_path / "p.jsonl"
    path.write_bytes('\ufeff{"prompt": "def f():", "class": "code", "max_tokens": 7}\r\nhello\r\n'.encode())
    got = read_prompts(path, default_class="chat", max_tokens=16)
    assert [(p.text, p.traffic_class, p.max_tokens) for p in got] == [
        ("def f():", "code", 7),
        ("hello", "chat", 16),
    ]
    path.write_bytes("\ufeffplain first\nsecond".encode())
    assert [p.text for p in read_prompts(path, default_class="chat", max_tokens=16)] == [
        "plain first",
        "second",
    ]
    path.write_bytes('\ufeff\n{"prompt": "x"}\n'.encode())  # a BOM alone on its line is a blank line
    assert [p.text for p in read_prompts(path, default_class="chat", max_tokens=16)] == ["x"]


_BIG = 11_500_000  # characters of non-ASCII text: a 34 MB answer, a 69 MB line once escaped


class _BigAnswer(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = "\u4e2d" * _BIG if body["prompt"] == "big" else "ok"
        resp = {
            "usage": {"prompt_tokens": 2, "completion_tokens": 4},
            "choices": [{"text": text, "prompt_token_ids": [1, 2], "token_ids": [1, 2, 1, 2]}],
            "metrics": {"speculative_decoding": {"per_step_accepted": [1, 0], "per_step_drafted": [2, 2]}},
        }
        data = json.dumps(resp, ensure_ascii=False, separators=(",", ":")).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def big_server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _BigAnswer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.integration
def test_an_answer_whose_line_the_import_would_refuse_is_one_failed_request(
    big_server: str, tmp_path: Path
) -> None:
    """An answer under the 64 MB read limit grows past the importer's line limit once written again as
    JSON (\\uXXXX escapes): the import then refused the whole recording, every good response with it."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("small\nbig\nsmall too\n")
    said: list[str] = []
    trace, failures, responses = record_trace(
        base_url=big_server,
        model="m",
        prompts=read_prompts(prompts, default_class="chat", max_tokens=4),
        out=tmp_path / "t.jsonl",
        method=Method.EAGLE3,
        concurrency=1,
        warn=said.append,
    )
    assert (trace.n, failures) == (2, 1)
    assert len(said) == 1 and "over the importer's limit" in said[0] and f"{prompts}:2" in said[0]
    assert max(len(x) for x in responses.read_bytes().splitlines()) < 1000
