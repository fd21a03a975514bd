"""write_trace -> read_trace keeps every column, and the writer never writes what its reader refuses.

Generated traces (hundreds of requests; every optional column present or absent; unicode ids and
classes; counts at 0, max_k and 2^31-1; sizes and arrival times at their limits) are written and
read back; every field must come back equal, ``arrival_s`` exactly (docs/spectrace.md: no rounding).
Broken traces (one fault each) must be refused by the writer with a TraceError, or read back equal.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.arms import Method
from sim.trace import (
    MAX_ARRIVAL_S,
    MAX_COUNT,
    MAX_K_LIMIT,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    TRACE_METHODS,
    Trace,
    TraceError,
    read_trace,
    validate_trace,
    write_trace,
)
from sim.traffic import SCENARIOS, generate

PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

names = st.text(min_size=1, max_size=12)  # any Unicode but lone surrogates, control characters included
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
metas = st.dictionaries(st.text(max_size=8).filter(lambda k: k != "ngram"), json_values, max_size=4)
#: Arrival times the writer used to lose (rounded to 6 decimals) and the range's ends.
ARRIVAL_EDGES = [0.0, 1e-7, 5e-324, 0.1 + 0.2, 123.4567890123, MAX_ARRIVAL_S, np.nextafter(MAX_ARRIVAL_S, 0)]


@st.composite
def traces(draw: st.DrawFn, max_requests: int = 400) -> Trace:
    """A valid trace: hypothesis picks its shape and edge values, a seeded generator fills the bulk."""
    small = st.integers(1, min(max_requests, 20))
    n = draw(
        small | st.integers(100, max_requests) if max_requests > 100 else small | st.integers(1, max_requests)
    )
    methods = tuple(draw(st.permutations(TRACE_METHODS))[: draw(st.integers(1, len(TRACE_METHODS)))])
    max_k = draw(st.sampled_from([1, 8, MAX_K_LIMIT]) | st.integers(1, MAX_K_LIMIT))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = rng.integers(1, draw(st.sampled_from([2, 8, 60])), n, endpoint=True)
    if draw(st.booleans()):  # a few long requests
        out[rng.integers(0, n, 3)] = rng.integers(1000, 5000, 3)
    if (out == 1).all():
        out[rng.integers(0, n)] = 2
    prompt = rng.choice(
        np.array([0, 1, MAX_PROMPT_TOKENS, int(rng.integers(0, MAX_PROMPT_TOKENS))]), n
    ).astype(np.int64)
    total = int(out.sum())

    def counts(hi: int) -> np.ndarray:
        pool = np.array([0, 1, hi, int(rng.integers(0, hi + 1))])
        a = rng.choice(pool, total)
        mixed = rng.random(total) < 0.3
        a[mixed] = rng.integers(0, min(hi, 100) + 1, int(mixed.sum()))
        return a.astype(np.int32)

    acc = {m: counts(draw(st.sampled_from([max_k, MAX_COUNT]))) for m in methods}
    proposal = counts(max_k) if draw(st.booleans()) else None
    if proposal is not None and Method.NGRAM in acc:  # n-gram accepts no more than it proposes
        ng = acc[Method.NGRAM]
        acc[Method.NGRAM] = np.where(proposal < max_k, np.minimum(ng, proposal), ng).astype(np.int32)
    arrival = np.full(n, np.nan)
    if draw(st.booleans()):
        arrival = rng.choice(np.array(ARRIVAL_EDGES), n)
        some = rng.random(n) < 0.5
        arrival[some] = rng.uniform(
            0, draw(st.sampled_from([1e-6, 1.0, 3600.0, MAX_ARRIVAL_S])), int(some.sum())
        )
    id_names = draw(st.lists(names, min_size=1, max_size=5))
    ids = [f"{id_names[i % len(id_names)]}{i}" for i in range(n)]
    for i, rid in enumerate(draw(st.lists(names, max_size=5))):  # some ids whole from hypothesis
        ids[(i * 7) % n] = rid
    seen: set[str] = set()
    for i, rid in enumerate(ids):  # unique, as the reader requires
        while rid in seen:
            rid += "'"
        ids[i] = rid
        seen.add(rid)
    class_names = draw(st.lists(names, min_size=1, max_size=5))
    classes = tuple(class_names[int(i)] for i in rng.integers(0, len(class_names), n))
    meta = draw(metas)
    if draw(st.booleans()):
        lo = draw(st.integers(1, 1 << 16))
        meta["ngram"] = {"min_n": lo, "max_n": draw(st.integers(lo, 1 << 16))}
    return Trace(
        max_k=max_k,
        methods=methods,
        ids=tuple(ids),
        classes=classes,
        prompt_tokens=prompt,
        output_tokens=out.astype(np.int64),
        arrival_s=arrival,
        acc=acc,
        meta=meta,
        ngram_proposal=proposal,
    )


def assert_same(got: Trace, want: Trace) -> None:
    """Every field of ``want`` in ``got``, with the reader's dtypes."""
    assert got.max_k == want.max_k and got.methods == want.methods
    assert got.ids == want.ids
    assert got.classes == want.classes
    for col in ("prompt_tokens", "output_tokens"):
        assert getattr(got, col).dtype == np.int64
        np.testing.assert_array_equal(getattr(got, col), getattr(want, col), err_msg=col)
    assert got.arrival_s.dtype == np.float64
    # exact: NaN (no arrival) in the same places, every other value the same float64
    np.testing.assert_array_equal(got.arrival_s, want.arrival_s, err_msg="arrival_s")
    assert set(got.acc) == set(want.methods)
    for m in want.methods:
        assert got.acc[m].dtype == np.int32
        np.testing.assert_array_equal(got.acc[m], want.acc[m], err_msg=f"acc.{m.value}")
    if want.ngram_proposal is None:
        assert got.ngram_proposal is None
    else:
        assert got.ngram_proposal is not None and got.ngram_proposal.dtype == np.int32
        np.testing.assert_array_equal(got.ngram_proposal, want.ngram_proposal, err_msg="ngram_proposal")
    assert json.dumps(dict(got.meta)) == json.dumps(dict(want.meta))  # order and types too
    assert got.meta == want.meta


def round_trip(t: Trace, name: str = "t.jsonl") -> Trace:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name
        write_trace(t, p)
        assert validate_trace(p) == []
        return read_trace(p)


@PROPERTY
@given(traces(), st.sampled_from(["t.jsonl", "t.jsonl.gz"]))
def test_every_column_survives_write_then_read(t: Trace, name: str) -> None:
    assert_same(round_trip(t, name), t)


@pytest.mark.parametrize("scenario", ["drift", "load-ramp"])
def test_generated_traces_round_trip(scenario: str) -> None:
    t = generate(SCENARIOS[scenario], n_requests=300, seed=3)
    assert t.has_arrivals == (scenario == "load-ramp")
    assert_same(round_trip(t), t)


def test_arrival_times_keep_full_precision() -> None:
    """The writer rounded arrival_s to 6 decimals: 1e-7 read back as 0 and close arrivals collapsed."""
    t = generate("load-ramp", n_requests=4, seed=0)
    t = dataclasses.replace(t, arrival_s=np.array([0.0, 1e-7, 2e-7, 1e9 - 1e-7]))
    back = round_trip(t)
    assert back.arrival_s.tolist() == [0.0, 1e-7, 2e-7, 1e9 - 1e-7]
    assert len(set(back.arrival_s.tolist())) == 4


def test_the_largest_request_round_trips() -> None:
    """output_tokens at its limit (2^22 positions), prompt_tokens at 2^24 and a count of 2^31-1."""
    n = MAX_OUTPUT_TOKENS
    acc = np.zeros(n + 2, dtype=np.int32)
    acc[::4096] = MAX_COUNT
    t = Trace(
        max_k=MAX_K_LIMIT,
        methods=(Method.EAGLE3,),
        ids=("big", "small"),
        classes=("c", "c"),
        prompt_tokens=np.array([MAX_PROMPT_TOKENS, 0], dtype=np.int64),
        output_tokens=np.array([n, 2], dtype=np.int64),
        arrival_s=np.array([MAX_ARRIVAL_S, 0.0]),
        acc={Method.EAGLE3: acc},
    )
    assert_same(round_trip(t, "big.jsonl.gz"), t)


# -- the writer refuses what the reader refuses --------------------------------------------------------


def _with(t: Trace, **changes: Any) -> Trace:
    return dataclasses.replace(t, **changes)


def _one(t: Trace, col: str, i: int, value: Any, dtype: Any = None) -> Trace:
    a = np.array(getattr(t, col), dtype=dtype or getattr(t, col).dtype)
    a[i] = value
    return _with(t, **{col: a})


def _tuple_at(t: Trace, col: str, i: int, value: Any) -> Trace:
    v = list(getattr(t, col))
    v[i] = value
    return _with(t, **{col: tuple(v)})


def _acc_at(t: Trace, value: int, i: int) -> Trace:
    m = t.methods[0]
    a = t.acc[m].astype(np.int64)
    a[i % len(a)] = value
    return _with(t, acc={**t.acc, m: a})


def _only_one_token(t: Trace) -> Trace:
    n = t.n
    return _with(
        t,
        output_tokens=np.ones(n, dtype=np.int64),
        acc={m: np.zeros(n, dtype=np.int32) for m in t.methods},
        ngram_proposal=None,
    )


def _nested(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


#: One fault each: (name, fault(trace, i) -> trace); i picks the request or position.
FAULTS: list[tuple[str, Callable[[Trace, int], Trace]]] = [
    ("empty id", lambda t, i: _tuple_at(t, "ids", i, "")),
    ("duplicate id", lambda t, i: _tuple_at(t, "ids", i, t.ids[i - 1])),
    ("surrogate id", lambda t, i: _tuple_at(t, "ids", i, "a\ud800")),
    ("empty class", lambda t, i: _tuple_at(t, "classes", i, "")),
    ("surrogate class", lambda t, i: _tuple_at(t, "classes", i, "\udfff")),
    ("negative prompt", lambda t, i: _one(t, "prompt_tokens", i, -1)),
    ("prompt over", lambda t, i: _one(t, "prompt_tokens", i, MAX_PROMPT_TOKENS + 1)),
    ("zero output", lambda t, i: _one(t, "output_tokens", i, 0)),
    ("one arrival missing", lambda t, i: _one(_with(t, arrival_s=np.zeros(t.n)), "arrival_s", i, np.nan)),
    ("negative arrival", lambda t, i: _one(_with(t, arrival_s=np.zeros(t.n)), "arrival_s", i, -1e-9)),
    ("infinite arrival", lambda t, i: _one(_with(t, arrival_s=np.zeros(t.n)), "arrival_s", i, np.inf)),
    ("late arrival", lambda t, i: _one(_with(t, arrival_s=np.zeros(t.n)), "arrival_s", i, 1e9 * (1 + 1e-15))),
    ("negative count", lambda t, i: _acc_at(t, -1, i)),
    ("count over int32", lambda t, i: _acc_at(t, MAX_COUNT + 1, i)),
    ("acc too short", lambda t, i: _with(t, acc={**t.acc, t.methods[0]: t.acc[t.methods[0]][:-1]})),
    ("acc too long", lambda t, i: _with(t, acc={**t.acc, t.methods[0]: np.append(t.acc[t.methods[0]], 0)})),
    ("acc missing", lambda t, i: _with(t, acc={m: a for m, a in t.acc.items() if m != t.methods[0]})),
    (
        "proposal over max_k",
        lambda t, i: _with(t, ngram_proposal=np.full(t.total_output_tokens, t.max_k + 1)),
    ),
    ("proposal negative", lambda t, i: _with(t, ngram_proposal=np.full(t.total_output_tokens, -1))),
    (
        "n-gram accepts more than it proposes",
        lambda t, i: _with(
            t,
            methods=(Method.NGRAM,),
            max_k=8,
            acc={Method.NGRAM: np.full(t.total_output_tokens, 2, dtype=np.int32)},
            ngram_proposal=np.full(t.total_output_tokens, 1, dtype=np.int32),
        ),
    ),
    ("max_k 0", lambda t, i: _with(t, max_k=0)),
    ("max_k over", lambda t, i: _with(t, max_k=MAX_K_LIMIT + 1)),
    ("no methods", lambda t, i: _with(t, methods=())),
    ("method off", lambda t, i: _with(t, methods=(Method.OFF,), acc={Method.OFF: t.acc[t.methods[0]]})),
    ("method twice", lambda t, i: _with(t, methods=(t.methods[0], t.methods[0]))),
    ("bad meta.ngram", lambda t, i: _with(t, meta={"ngram": {"min_n": 0, "max_n": 3}})),
    ("meta not JSON", lambda t, i: _with(t, meta={"x": {1, 2}})),
    ("meta surrogate key", lambda t, i: _with(t, meta={"\ud800": 1})),
    ("meta nested too deep", lambda t, i: _with(t, meta={"x": _nested(40)})),
    ("meta integer over Python's limit", lambda t, i: _with(t, meta={"x": 10**5000})),
    ("no requests", lambda t, i: t.subset([])),
    ("every output_tokens 1", lambda t, i: _only_one_token(t)),
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(max_requests=40), st.sampled_from(FAULTS), st.integers(0, 10**6))
def test_the_writer_never_writes_what_the_reader_refuses(
    t: Trace, fault: tuple[str, Callable[[Trace, int], Trace]], at: int
) -> None:
    name, fn = fault
    bad = fn(t, at % t.n)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.jsonl"
        try:
            write_trace(bad, p)
        except TraceError as e:
            assert str(e).startswith(str(p)) and "\n" not in str(e), str(e)
            assert not p.exists(), "a refused trace left a file"
            return
        # Written: then it must read back, whole.
        errors = validate_trace(p)
        assert errors == [], f"{name}: the writer wrote what the reader refuses: {errors[0]}"
        assert_same(read_trace(p), bad)


@pytest.mark.parametrize(("name", "fault"), FAULTS, ids=[f[0] for f in FAULTS])
def test_each_fault_is_refused_by_the_writer_naming_it(
    name: str, fault: Callable[[Trace, int], Trace], tmp_path: Path
) -> None:
    """Every fault above is one the reader refuses, so the writer must refuse it too."""
    t = generate("load-ramp", n_requests=5, seed=2)
    bad = fault(t, 3)
    p = tmp_path / "t.jsonl"
    with pytest.raises(TraceError) as e:
        write_trace(bad, p)
    assert not p.exists()
    assert str(e.value).startswith(f"{p}")


def test_a_refusal_names_the_request_and_its_line(tmp_path: Path) -> None:
    t = generate("drift", n_requests=5, seed=0)
    with pytest.raises(TraceError) as e:
        write_trace(_tuple_at(t, "classes", 3, ""), tmp_path / "t.jsonl")
    assert str(e.value) == (
        f"{tmp_path / 't.jsonl'}:5: class: must be a non-empty string "
        "(request 3, id 'r3'; not written: read_trace would refuse it)"
    )
    with pytest.raises(TraceError, match=r":4: arrival_s: given on some requests but not on this one"):
        write_trace(_one(_with(t, arrival_s=np.zeros(5)), "arrival_s", 2, np.nan), tmp_path / "t.jsonl")
    with pytest.raises(TraceError, match=r":3: id: duplicate id 'r0' \(first on line 2\)"):
        write_trace(_tuple_at(t, "ids", 1, "r0"), tmp_path / "t.jsonl")
    with pytest.raises(
        TraceError, match=r":4: output_tokens: required: an integer 1\.\.4194304, got 0 \(request 2,"
    ):
        write_trace(_one(t, "output_tokens", 2, 0), tmp_path / "t.jsonl")
    longer = {**t.acc, Method.EAGLE3: np.concatenate([t.acc[Method.EAGLE3], [0]])}
    with pytest.raises(
        TraceError, match=r"t\.jsonl: acc\.eagle3: \d+ positions, but output_tokens sum to \d+$"
    ):
        write_trace(_with(t, acc=longer), tmp_path / "t.jsonl")
    assert not (tmp_path / "t.jsonl").exists()
