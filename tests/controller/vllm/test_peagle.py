"""The P-EAGLE depth fix against a fake parallel drafter that reshapes as vLLM 0.32 does (one sample per
laid-out slot, then ``view(-1, K)``): every request gets its own first K tokens at every K and batch
size, sequential drafters pass through, and a mismatched vLLM is left unpatched with one log line."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.vllm import compat, peagle
from controller.vllm.control import Controls, engine_info
from controller.vllm.mode import P_EAGLE_MAX_K_ONLY, plugin_mode
from policies.arms import Arm, Method
from policies.directive import Directive, KRange

VOCAB = 5


class FakeProposer:
    """vLLM's reshape: ``slots`` samples per request, returned as ``view(-1, K)``. Request r's token at
    slot s is ``100 r + s``, so a misassigned row shows at once."""

    def __init__(self, slots: int, *, parallel: bool = True) -> None:
        self.parallel_drafting = parallel
        self.extra_slots_per_request = slots if parallel else 1
        self.num_speculative_tokens = slots
        self._last_draft_probs: np.ndarray | None = None
        self.calls: list[int] = []

    def propose(self, num_speculative_tokens: int, batch: int, *, probs: bool = False) -> np.ndarray:
        k = self.num_speculative_tokens = num_speculative_tokens
        self.calls.append(k)
        per = self.extra_slots_per_request if self.parallel_drafting else k
        samples = np.array([100 * r + s for r in range(batch) for s in range(per)], dtype=np.int64)
        if k == 0:
            return np.empty((batch, 0), dtype=np.int64)
        if probs:
            self._last_draft_probs = (
                np.repeat(samples[:, None], VOCAB, axis=1).astype(np.float64).reshape(-1, k, VOCAB)
            )
        return samples.reshape(-1, k)


def _fixed(p: FakeProposer, k: int, batch: int, **kw: Any) -> np.ndarray:
    return np.asarray(peagle.propose_at_depth(FakeProposer.propose, p, k, batch, **kw))


def test_the_fake_reproduces_vllms_misassignment() -> None:
    # The bug the fix is for: at K = 2 of 4 slots, request 1 receives request 0's tail.
    got = FakeProposer(4).propose(2, 3)
    assert got[:3].tolist() == [[0, 1], [2, 3], [100, 101]]


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(1, 16), batch=st.integers(1, 512), data=st.data())
def test_every_request_gets_its_own_first_k_tokens(slots: int, batch: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, slots), label="k")
    p = FakeProposer(slots)
    got = _fixed(p, k, batch, probs=True)
    assert got.shape == (batch, k)
    assert got.tolist() == [[100 * r + s for s in range(k)] for r in range(batch)]
    assert p.num_speculative_tokens == k  # as vLLM leaves it after a call at K
    # The full depth only where the reshape would misassign (0 < K < slots).
    assert p.calls == [slots if 0 < k < slots else k]
    if k:
        probs = p._last_draft_probs
        assert probs is not None and probs.shape == (batch, k, VOCAB)
        assert (probs[:, :, 0] == got).all()


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_sequential_drafters_pass_through(k: int) -> None:
    p = FakeProposer(4, parallel=False)
    got = _fixed(p, k, 3)
    assert p.calls == [k] and got.shape == (3, k)
    assert peagle.partial_depth(p, k) is None


def _fake_module(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    names = ("vllm", "vllm.v1", "vllm.v1.spec_decode", "vllm.v1.spec_decode.llm_base_proposer")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].SpecDecodeBaseProposer = cls  # type: ignore[attr-defined]


def test_install_wraps_once_and_fixes_the_depth(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cls = type("SpecDecodeBaseProposer", (FakeProposer,), {})
    _fake_module(monkeypatch, cls)
    assert peagle.depth_fix_problem() is None
    with caplog.at_level(logging.INFO, logger="vllm.speccontrol"):
        assert peagle.install_depth_fix() is None
        wrapped = cls.propose
        assert peagle.install_depth_fix() is None  # idempotent
    assert cls.propose is wrapped and wrapped.__wrapped__ is FakeProposer.propose  # type: ignore[attr-defined]
    assert cls(4).propose(2, 3).tolist() == [[0, 1], [100, 101], [200, 201]]
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_mismatched_vllm_is_left_unpatched_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def propose(self: Any, k: int, batch: int) -> Any:  # vLLM renamed the parameter
        return FakeProposer.propose(self, k, batch)

    cls = type("SpecDecodeBaseProposer", (FakeProposer,), {"propose": propose})
    _fake_module(monkeypatch, cls)
    with caplog.at_level(logging.INFO, logger="vllm.speccontrol"):
        why = peagle.install_depth_fix()
    assert why is not None and "SpecDecodeBaseProposer.propose: expected parameters" in why
    assert cls.propose is propose
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.ERROR
    assert "K in {0, max} only" in caplog.records[0].getMessage()
    assert peagle.depth_fix_problem() == why


def test_missing_vllm_is_a_problem_not_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm.v1.spec_decode.llm_base_proposer", None)
    why = peagle.install_depth_fix()
    assert why is not None and "missing" in why
    assert compat.P_EAGLE_POINTS[0].name in why


def _controls(depths: bool, composite: bool) -> Controls:
    info = engine_info(engine_id="e", model="m", method=Method.P_EAGLE, max_k=4, max_batch_size=8,
                       composite=composite, p_eagle_depths=depths)  # fmt: skip
    return Controls(engine=info, method=Method.P_EAGLE, safe_default=Arm(Method.P_EAGLE, 4),
                    composite=composite, p_eagle_depths=depths)  # fmt: skip


def _table_directive() -> Directive:
    return Directive(version=3, policy="p", reason="", ttl_s=10, issued_at_s=0, method=Method.P_EAGLE,
                     k_table=(KRange(1, 1, 1), KRange(2, 3, 2), KRange(4, 0, 3)))  # fmt: skip


@pytest.mark.parametrize("composite", [True, False])
def test_with_the_fix_the_p_eagle_table_takes_every_k(composite: bool) -> None:
    c = _controls(True, composite)
    assert c.k_table(_table_directive()) == [4, 1, 2, 2, 3, 3, 3, 3, 3]
    assert c.engine.p_eagle_partial_k_safe
    assert Arm(Method.P_EAGLE, 2) in c.engine.playable(())


def test_without_the_fix_the_table_stays_at_zero_or_max() -> None:
    c = _controls(False, composite=False)
    assert c.k_table(_table_directive()) == [4] * 9
    assert not c.engine.p_eagle_partial_k_safe
    assert [a for a in c.engine.playable(()) if a.method is Method.P_EAGLE] == [Arm(Method.P_EAGLE, 4)]
    # The composite drafter cuts drafts per request, so every K is playable per request.
    assert _controls(False, composite=True).engine.p_eagle_partial_k_safe


def test_mode_says_when_p_eagle_is_held_at_max() -> None:
    assert plugin_mode(None) == "per-request composite"
    got = plugin_mode(None, p_eagle_depths="SpecDecodeBaseProposer.propose: missing")
    assert got == f"per-request composite; {P_EAGLE_MAX_K_ONLY}: SpecDecodeBaseProposer.propose: missing"
