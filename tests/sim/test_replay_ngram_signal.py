"""The replay hands the policy the n-gram proposer's match causally: what the engine has before drafting."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.arms import METHOD_CODES, Method
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.spec import parse_policy
from sim.costmodel import load_profile
from sim.engines import ENGINES
from sim.replay import Replayer
from sim.trace import Trace
from sim.traffic import generate

DEFAULT = Path(__file__).resolve().parents[2] / "policies" / "library" / "default.yaml"
NG = METHOD_CODES[Method.NGRAM]


def _default() -> Any:
    return parse_policy(DEFAULT.read_text(encoding="utf-8"), source=str(DEFAULT))


def _steps(
    monkeypatch: pytest.MonkeyPatch,
    trace: Trace,
    *,
    signal: bool = True,
    engine: str = "composite",
    c: int = 1,
) -> list[StepObservation]:
    seen: list[StepObservation] = []
    orig = ControlLoop.observe

    def spy(self: ControlLoop, batch: StepBatch) -> None:
        seen.extend(batch.steps)
        orig(self, batch)

    monkeypatch.setattr(ControlLoop, "observe", spy)
    Replayer(
        trace=trace,
        profile=load_profile("llama-3.1-8b-h100"),
        engine=ENGINES[engine],
        policy=_default(),
        concurrency=c,
        seed=0,
        ngram_signal=signal,
    ).run()
    monkeypatch.setattr(ControlLoop, "observe", orig)
    return seen


def _positions(steps: list[StepObservation]) -> list[int]:
    """Each step's position for a one-request trace (prefill made token 0)."""
    pos, out = 0, []
    for s in steps:
        out.append(pos)
        pos += int(s.accepted[0]) + 1
    return out


def test_the_policy_sees_the_proposal_at_the_position_it_drafts_from(monkeypatch: pytest.MonkeyPatch) -> None:
    tr = generate("code-edit", n_requests=1, seed=2)
    assert tr.ngram_proposal is not None and tr.output_tokens[0] >= 50
    steps = _steps(monkeypatch, tr)
    pos = _positions(steps)
    for s, p in zip(steps, pos, strict=True):
        assert s.ngram_proposal is not None and s.ngram_proposal.tolist() == [int(tr.ngram_proposal[p])]
        if s.method[0] == NG:
            assert tr.ngram_proposal[p] > 0 and 1 <= s.k[0] <= tr.ngram_proposal[p]
    assert any(s.method[0] == NG for s in steps)


def test_decisions_before_a_position_do_not_depend_on_what_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrite one request's future (acceptance and proposals from position 120 on): every step that
    drafts from an earlier position decides exactly as before."""
    tr = generate("code-edit", n_requests=1, seed=5)
    n = int(tr.output_tokens[0])
    assert n > 200
    cut = 120
    rng = np.random.default_rng(1)
    future_ng = np.where(rng.random(n - cut) < 0.5, rng.integers(1, 9, n - cut), 0).astype(np.int32)
    acc = {m: a.copy() for m, a in tr.acc.items()}
    acc[Method.NGRAM][cut:] = future_ng
    acc[Method.EAGLE3][cut:] = rng.integers(0, 5, n - cut)
    assert tr.ngram_proposal is not None
    prop = tr.ngram_proposal.copy()
    prop[cut:] = np.where(future_ng > 0, tr.max_k, 0)
    other = replace(tr, acc=acc, ngram_proposal=prop)
    a, b = _steps(monkeypatch, tr), _steps(monkeypatch, other)
    before = sum(1 for p in _positions(a) if p < cut)
    assert before > 10
    for x, y in zip(a[:before], b[:before], strict=True):
        assert (x.method.tolist(), x.k.tolist(), x.accepted.tolist()) == (
            y.method.tolist(),
            y.k.tolist(),
            y.accepted.tolist(),
        )
    assert [(s.method.tolist(), s.k.tolist()) for s in a] != [(s.method.tolist(), s.k.tolist()) for s in b]


def test_the_signal_is_withheld_when_off_or_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    tr = generate("chat", n_requests=4, seed=1)
    assert all(s.ngram_proposal is None for s in _steps(monkeypatch, tr, signal=False, c=2))
    assert all(s.ngram_proposal is None for s in _steps(monkeypatch, replace(tr, ngram_proposal=None), c=2))
    # A stock engine runs no per-request n-gram proposer: nothing to report.
    assert all(s.ngram_proposal is None for s in _steps(monkeypatch, tr, engine="stock-vllm", c=2))
    on = _steps(monkeypatch, tr, c=2)
    assert on and all(s.ngram_proposal is not None and len(s.ngram_proposal) == s.n for s in on)


def test_the_signal_raises_throughput_on_a_copy_heavy_trace() -> None:
    tr = generate("drift", n_requests=240, seed=0)
    runs = {
        sig: Replayer(
            trace=tr,
            profile=load_profile("llama-3.1-8b-h100"),
            engine=ENGINES["composite"],
            policy=_default(),
            concurrency=8,
            seed=0,
            ngram_signal=sig,
        ).run()
        for sig in (False, True)
    }
    assert runs[True].throughput > runs[False].throughput
    assert runs[True].output_tokens.sum() == runs[False].output_tokens.sum() == tr.total_output_tokens
