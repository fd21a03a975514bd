"""Writing traces at realistic sizes: ``write_trace`` streams in chunks and ``trace record`` holds no
answer past its writing.

What must hold: the bytes written are the ones the whole-text writer made (the text, or
``gzip.compress(text, mtime=0)``) whatever the chunking; memory is a chunk and a line, not the text;
a write that fails (a bad request late in the trace, a limit, a full disk, Ctrl-C) leaves the old file
as it was and no ``NAME.tmp``; the responses file of a recording is in prompt order whatever order the
answers came in.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import tempfile
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.trace as trace_mod
from policies.arms import Method
from sim.record import Prompt, record
from sim.trace import Trace, TraceError, TraceLimits, trace_lines, write_trace


def _trace(n: int, length: int, seed: int = 0, *, max_k: int = 8, arrivals: bool = True) -> Trace:
    rng = np.random.default_rng(seed)
    out = rng.integers(1, 2 * length, n) if length > 1 else np.full(n, 2)
    out[0] = max(out[0], 2)  # (a trace whose every request has one token is refused: nothing to replay)
    total = int(out.sum())
    proposal = rng.integers(0, max_k + 1, total).astype(np.int32)
    ngram = np.minimum(rng.integers(0, max_k + 1, total), proposal).astype(np.int32)
    return Trace(
        max_k=max_k,
        methods=(Method.EAGLE3, Method.NGRAM),
        ids=tuple(f"r{i}" for i in range(n)),
        classes=tuple(("chat", "code")[i % 2] for i in range(n)),
        prompt_tokens=rng.integers(0, 4000, n).astype(np.int64),
        output_tokens=out.astype(np.int64),
        arrival_s=np.sort(rng.random(n) * 1e4) if arrivals else np.full(n, np.nan),
        acc={Method.EAGLE3: rng.integers(0, max_k + 1, total).astype(np.int32), Method.NGRAM: ngram},
        meta={"source": "test", "ngram": {"min_n": 1, "max_n": 3}},
        name="t",
        ngram_proposal=proposal,
    )


def _whole_text(tr: Trace, path: Path) -> bytes:
    """What ``write_trace`` wrote when it held the whole text."""
    text = "".join(line + "\n" for line in trace_lines(tr, source=str(path))).encode("utf-8")
    return gzip.compress(text, mtime=0) if path.suffix == ".gz" else text


def _peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_memory_is_a_chunk_not_the_text(tmp_path: Path, suffix: str) -> None:
    """The whole text, its bytes and its gzip were held at once, and every request's lists of Python
    ints (36 bytes a position and column) to the end: 5x the text (11 MB here), where it is now a few
    chunks and some hundred bytes a request (what the rules across requests ask)."""
    chunk = 1 << 16
    tr = _trace(2000, 150, seed=1)
    out = tmp_path / f"t{suffix}"
    with mock.patch.object(trace_mod, "_WRITE_CHUNK_BYTES", chunk, create=True):
        peak = _peak(lambda: write_trace(tr, out))
    whole = _whole_text(tr, out)
    text_bytes = len(gzip.decompress(whole)) if suffix == ".jsonl.gz" else len(whole)
    assert text_bytes > 30 * chunk  # (the trace spans many chunks)
    assert peak < 4 * chunk + 1000 * tr.n, (peak, text_bytes)
    assert out.read_bytes() == whole


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    length=st.integers(1, 300),
    chunk=st.integers(1, 20_000),
    gz=st.booleans(),
    arrivals=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_the_bytes_are_the_whole_text_writers_at_any_chunking(
    n: int, length: int, chunk: int, gz: bool, arrivals: bool, seed: int
) -> None:
    tr = _trace(n, length, seed, arrivals=arrivals)
    with (
        tempfile.TemporaryDirectory() as d,
        mock.patch.object(trace_mod, "_WRITE_CHUNK_BYTES", chunk, create=True),
    ):
        out = Path(d) / ("t.jsonl.gz" if gz else "t.jsonl")
        write_trace(tr, out)
        assert out.read_bytes() == _whole_text(tr, out)
        assert sorted(os.listdir(d)) == [out.name]


def _bad_last_request(tr: Trace) -> Trace:
    assert tr.ngram_proposal is not None
    bad = tr.ngram_proposal.copy()
    bad[-1] = tr.max_k + 1  # the last request's last position: refused by the reader
    return Trace(**{**{f: getattr(tr, f) for f in Trace.__dataclass_fields__}, "ngram_proposal": bad})


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_bad_request_after_many_chunks_leaves_the_old_file(tmp_path: Path, suffix: str) -> None:
    tr = _bad_last_request(_trace(200, 300, seed=2))
    out = tmp_path / f"t{suffix}"
    out.write_bytes(b"old")
    with (
        mock.patch.object(trace_mod, "_WRITE_CHUNK_BYTES", 4096, create=True),
        pytest.raises(TraceError) as e,
    ):
        write_trace(tr, out)
    assert str(e.value).startswith(f"{out}:{tr.n + 1}: ngram_proposal["), str(e.value)
    assert out.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == [out.name]


def test_ctrl_c_mid_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    tr = _trace(200, 300, seed=3)
    out = tmp_path / "t.jsonl"
    out.write_bytes(b"old")
    real = trace_mod.trace_lines

    def interrupted(*args: Any, **kwargs: Any) -> Iterator[str]:
        for i, line in enumerate(real(*args, **kwargs)):
            if i == 150:
                raise KeyboardInterrupt
            yield line

    with (
        mock.patch.object(trace_mod, "_WRITE_CHUNK_BYTES", 4096, create=True),
        mock.patch.object(trace_mod, "trace_lines", interrupted),
        pytest.raises(KeyboardInterrupt),
    ):
        write_trace(tr, out)
    assert out.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == [out.name]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_limits_name_the_whole_size_and_write_nothing(tmp_path: Path, suffix: str) -> None:
    tr = _trace(100, 300, seed=4)
    out = tmp_path / f"t{suffix}"
    text = _whole_text(tr, tmp_path / "t.jsonl")
    with mock.patch.object(trace_mod, "_WRITE_CHUNK_BYTES", 4096, create=True):
        with pytest.raises(TraceError) as e:
            write_trace(tr, out, limits=TraceLimits(max_decompressed_bytes=len(text) // 3))
        assert str(e.value) == (
            f"{out}: {len(text)} bytes of text, over the reader's limit of {len(text) // 3}"
        )
        whole = _whole_text(tr, out)
        with pytest.raises(TraceError) as e:
            write_trace(tr, out, limits=TraceLimits(max_file_bytes=len(whole) - 1))
        assert str(e.value) == f"{out}: {len(whole)} bytes, over the reader's limit of {len(whole) - 1}"
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to fail a write")
def test_a_full_disk_names_the_file_and_leaves_the_old_one(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    out.write_bytes(b"old")
    (tmp_path / "t.jsonl.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as e:
        write_trace(_trace(50, 300, seed=5), out)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(out)
    assert out.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == [out.name]


def test_a_link_has_its_target_replaced_and_a_fifo_is_refused(tmp_path: Path) -> None:
    tr = _trace(5, 20, seed=6)
    target = tmp_path / "real.jsonl"
    target.write_bytes(b"old")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    write_trace(tr, link)
    assert link.is_symlink() and target.read_bytes() == _whole_text(tr, link)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as e:
        write_trace(tr, fifo)
    assert e.value.errno == errno.EINVAL and e.value.filename == str(fifo)


# -- trace record: answers that finish out of order ----------------------------------------------

_N, _TOKENS = 60, 20_000
_BODY = json.dumps(
    {
        "usage": {"prompt_tokens": 5, "completion_tokens": _TOKENS},
        "choices": [
            {"text": "", "prompt_token_ids": [1, 2, 3, 4, 5], "token_ids": list(range(1000, 1000 + _TOKENS))}
        ],
        "metrics": {"speculative_decoding": {"per_step_accepted": [1], "per_step_drafted": [2]}},
    }
).encode()


class _SlowFirst(BaseHTTPRequestHandler):
    """Answers every prompt alike, the first ("p0") only once every other one was answered."""

    answered = 0
    lock = threading.Lock()
    others_done = threading.Event()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        first = body["prompt"] == "p0"
        if first:
            self.others_done.wait(120)  # (a bound only so that a broken recorder cannot hang the run)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(_BODY)))
        self.end_headers()
        self.wfile.write(_BODY)
        if not first:
            with self.lock:
                type(self).answered += 1
                if self.answered == _N - 1:
                    self.others_done.set()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.integration
def test_answers_behind_a_slow_one_are_not_held_and_come_out_in_prompt_order(tmp_path: Path) -> None:
    """Taken in prompt order, all 59 answers behind the first were held in memory until it came
    (46 MB here: gigabytes for a long recording behind one long request)."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SlowFirst)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        prompts = [Prompt(f"p{i}", ("chat", "code")[i % 2], 8) for i in range(_N)]
        responses = tmp_path / "t.responses.jsonl"
        failures: list[int] = []
        peak = _peak(
            lambda: failures.append(
                record(
                    base_url=f"http://127.0.0.1:{srv.server_address[1]}",
                    model="m",
                    prompts=prompts,
                    responses_path=responses,
                    concurrency=4,
                )
            )
        )
    finally:
        srv.shutdown()
        srv.server_close()
    assert _SlowFirst.others_done.is_set() and failures == [0]
    assert peak < 12 * len(_BODY) * 4, peak  # a few answers per worker, not all of them
    lines = responses.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["id"] for line in lines] == [f"r{i}" for i in range(_N)]
    for i, line in enumerate(lines):
        obj = json.loads(line)
        assert obj["traffic_class"] == prompts[i].traffic_class
        assert obj["choices"][0]["token_ids"] == list(range(1000, 1000 + _TOKENS))
    assert sorted(os.listdir(tmp_path)) == ["t.responses.jsonl"]
