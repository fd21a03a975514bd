"""``trace import --tokens`` at realistic sizes: memory linear in the tokens whatever ``--max-n``, the same
matches as vLLM's rule at long n-gram sizes, and hostile lines refused as ``FILE:LINE`` errors.

What must hold: ``ngram_columns`` gives ``match_ngram``'s draft at every position (longest suffix
n-gram of min_n..max_n seen earlier, earliest occurrence) and holds memory proportional to the
request's tokens (it held ~15 KB a token at max_n 63: 2 GB for a 128k-token prompt).
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.prompt_lookup import MAX_NGRAM, match_ngram
from sim.cli import main
from sim.importer import NGRAM_HORIZON, import_token_ids, ngram_columns
from sim.trace import read_trace

INT32_MAX = (1 << 31) - 1


def _at(tokens: np.ndarray, p: int, t: int, min_n: int, max_n: int, max_k: int) -> tuple[int, int]:
    """(count, proposal) at output position t, by vLLM's rule on the history itself."""
    end = p + t + 1
    draft = match_ngram(tokens[:end], min_n, max_n, 1 << 40, NGRAM_HORIZON)
    nxt = tokens[end : end + len(draft)]
    same = draft[: len(nxt)] == nxt
    count = 0 if not len(draft) else (len(nxt) if same.all() else int(np.argmin(same)))
    return count, min(len(draft), max_k)


def _peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _repetitive(rng: np.random.Generator, prompt_len: int, out_len: int, vocab: int) -> tuple[Any, Any]:
    """A prompt and an output that copies spans of its history (as code edits and RAG answers do)."""
    prompt = rng.integers(0, vocab, prompt_len)
    out = rng.integers(0, vocab, out_len)
    for s in range(0, out_len - 200, 300):
        src = int(rng.integers(0, prompt_len - 200))
        out[s : s + 150] = prompt[src : src + 150]
    return prompt, out


def test_memory_is_linear_in_the_tokens_at_max_n_63() -> None:
    """An index of every n-gram's bytes for each n up to max_n held ~13 KB a token (120 MB here);
    the peak is now a few arrays of the request's length."""
    rng = np.random.default_rng(0)
    prompt, out = _repetitive(rng, 8000, 1000, 50)
    tokens = len(prompt) + len(out)
    peak = _peak(lambda: ngram_columns(prompt, out, min_n=1, max_n=MAX_NGRAM, max_k=8))
    assert peak < 400 * tokens, f"{peak} bytes for {tokens} tokens"


def test_a_128k_token_prompt_imports_at_max_n_63_in_bounded_memory(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    prompt, out = _repetitive(rng, 128_000, 2000, 32_000)
    src = tmp_path / "long.jsonl"
    src.write_text(
        json.dumps({"prompt_token_ids": prompt.tolist(), "output_token_ids": out.tolist()}) + "\n",
        encoding="utf-8",
    )
    got: list[Any] = []
    peak = _peak(lambda: got.append(import_token_ids(src, min_n=1, max_n=MAX_NGRAM, max_k=8)))
    # The line's JSON list of Python ints alone takes ~36 bytes a token; the old index gigabytes.
    tokens = len(prompt) + len(out)
    assert peak < 400 * tokens, f"{peak} bytes for {tokens} tokens ({src.stat().st_size} bytes of file)"
    tr = got[0]
    assert tr.total_output_tokens == len(out)
    assert tr.ngram_proposal is not None and tr.ngram_proposal.any()
    tokens_all = np.concatenate([prompt, out])
    for t in [0, 1, 149, 150, 151, 299, 300, 301, 1000, len(out) - 2, len(out) - 1]:
        got_t = (int(tr.acc[next(iter(tr.acc))][t]), int(tr.ngram_proposal[t]))
        assert got_t == _at(tokens_all, len(prompt), t, 1, MAX_NGRAM, 8), t


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.sampled_from([1, 2, 3, 7]),
    prompt_len=st.integers(0, 80),
    out_len=st.integers(1, 160),
    min_n=st.integers(1, 6),
    span=st.integers(0, MAX_NGRAM - 1),
    max_k=st.integers(1, 64),
    high=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_position_matches_vllms_rule_up_to_max_n_63(
    vocab: int, prompt_len: int, out_len: int, min_n: int, span: int, max_k: int, high: bool, seed: int
) -> None:
    """Long n-gram sizes over histories full of repeats (long equal runs, copied spans), token ids at
    the int32 edge too: the ranks must never merge two different n-grams."""
    max_n = min(MAX_NGRAM, min_n + span)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, prompt_len + out_len).astype(np.int64)
    if high:  # ids at both ends of the range a token id may take
        tokens = np.where(tokens % 2 == 0, INT32_MAX - tokens, tokens)
    prompt, out = tokens[:prompt_len], tokens[prompt_len:]
    acc, prop = ngram_columns(prompt, out, min_n=min_n, max_n=max_n, max_k=max_k)
    want = [_at(tokens, prompt_len, t, min_n, max_n, max_k) for t in range(out_len)]
    assert list(zip(acc.tolist(), prop.tolist(), strict=True)) == want


def test_ten_thousand_short_requests_import_as_the_rule_says(tmp_path: Path) -> None:
    """Many short requests (the 10^5-request file's shape, at a tenth): every one scored alone."""
    rng = np.random.default_rng(3)
    rows, want_acc, want_prop = [], [], []
    for i in range(10_000):
        p = rng.integers(0, 40, int(rng.integers(0, 60)))
        o = rng.integers(0, 40, int(rng.integers(1, 40)))
        if len(p) > 10 and len(o) > 12:
            o[2:12] = p[:10]
        rows.append(
            json.dumps({"id": f"q{i}", "prompt_token_ids": p.tolist(), "output_token_ids": o.tolist()})
        )
        if i % 500 == 0:  # spot checks by the rule itself
            toks = np.concatenate([p, o])
            for t in range(len(o)):
                a, pr = _at(toks, len(p), t, 4, 5, 8)
                want_acc.append((i, t, a))
                want_prop.append((i, t, pr))
    src = tmp_path / "many.jsonl"
    src.write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "o.jsonl.gz"
    assert main(["trace", "import", "--tokens", str(src), "--out", str(out)]) == 0
    tr = read_trace(out)
    assert tr.n == 10_000 and tr.ngram_proposal is not None
    off = tr.offsets
    ng = tr.acc[next(m for m in tr.acc if m.value == "ngram")]
    for (i, t, a), (_, _, pr) in zip(want_acc, want_prop, strict=True):
        assert (int(ng[off[i] + t]), int(tr.ngram_proposal[off[i] + t])) == (a, pr), (i, t)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            b'{"prompt_token_ids":[1],"output_token_ids":[2147483648,1]}\n',
            "output_token_ids[0]: must be a token id",
        ),
        (b'{"prompt_token_ids":[-1],"output_token_ids":[1,2]}\n', "prompt_token_ids[0]: must be a token id"),
        (
            b'{"prompt_token_ids":[1],"output_token_ids":[1,9223372036854775808]}\n',
            "output_token_ids[1]: must be a token id",
        ),
        (
            b'{"prompt_token_ids":[1],"output_token_ids":[1,-9223372036854775809]}\n',
            "output_token_ids[1]: must be a token id",
        ),
        (b'{"prompt_token_ids":[1],"output_token_ids":[]}\n', "output_token_ids: required"),
        (b'{"prompt_token_ids":[1],"output_token_ids":[1.0,2]}\n', "output_token_ids[0]: must be a token id"),
        (b'{"prompt_token_ids":[1],"output_token_ids":[1,2]} trailing\n', "invalid JSON: Extra data"),
        (
            b'\xef\xbb\xbf{"prompt_token_ids":[1],"output_token_ids":[1,2]}\n',
            "invalid JSON: Unexpected UTF-8 BOM",
        ),
        (b'{"prompt_token_ids":[1],"output_token_ids":[1,2]}\r\n\xff\r\n', "not valid UTF-8 text"),
    ],
)
def test_hostile_lines_are_file_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: bytes, says: str
) -> None:
    src = tmp_path / "t.jsonl"
    src.write_bytes(text)
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", "--tokens", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    line = 2 if b"\xff" in text else 1
    assert err.startswith(f"{src}:{line}: ") and says in err and "Traceback" not in err, err
    assert not out.exists()


def test_crlf_lines_and_int32_edge_ids_import(tmp_path: Path) -> None:
    top = INT32_MAX
    rows = [
        {"prompt_token_ids": [0, top, 0, top], "output_token_ids": [0, top, 0, top, 5]},
        {"prompt_token_ids": [], "output_token_ids": [top, top, top, top, top]},
    ]
    src = tmp_path / "t.jsonl"
    src.write_bytes(b"".join(json.dumps(r).encode() + b"\r\n" for r in rows))
    tr = import_token_ids(src, min_n=1, max_n=2, max_k=8)
    ng = tr.acc[next(m for m in tr.acc if m.value == "ngram")]
    for i, r in enumerate(rows):
        toks = np.array(r["prompt_token_ids"] + r["output_token_ids"], dtype=np.int64)
        p = len(r["prompt_token_ids"])
        for t in range(len(r["output_token_ids"])):
            assert (int(ng[tr.offsets[i] + t]), int(tr.ngram_proposal[tr.offsets[i] + t])) == _at(  # type: ignore[index]
                toks, p, t, 1, 2, 8
            )
