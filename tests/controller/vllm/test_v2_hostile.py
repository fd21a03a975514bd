"""Hostile checks of the V2-runner speculator wrapper (``controller.vllm.v2``): vLLM's runner treats its
speculator by type and sets attributes on it, so the wrapper must be EAGLE's own class on EAGLE's own
state; merged drafts must equal a plain-python reference step after step (rows flipping between
n-gram and EAGLE, slots reused, K = 0 steps, dummy runs, token ids at the int32 edges)."""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.vllm import v2
from controller.vllm.mode import NGRAM_ROWS_ATTR
from controller.vllm.v2 import CompositeSpeculator

K = 4
I32 = (1 << 31) - 1


class FakeDraftModelSpeculator:
    """vLLM's ``DraftModelSpeculator`` as the V2 runner uses it: it loads its model and sets its
    attention up only when ``isinstance(runner.speculator, DraftModelSpeculator)``, and the runner
    sets ``pcp_manager`` on whatever speculator it holds."""

    def __init__(self) -> None:
        self.model: Any = None
        self.attn: Any = None
        self.pcp_manager: Any = None

    def load_model(self, target: Any) -> None:
        self.model = f"draft of {target}"

    def set_attn(self, attn: Any) -> None:
        self.attn = attn

    def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        if self.model is None or self.attn is None:
            raise AttributeError("EAGLE proposes without its model or attention (never loaded)")
        n = len(input_batch.idx_mapping)
        return np.full((n, K), 100, dtype=np.int64)


class FakeNgram:
    def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        return np.full((len(input_batch.idx_mapping), K), 200, dtype=np.int64)


def _fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The modules ``install_v2_runner`` patches, its runner written as vLLM's V2 runner treats its
    speculator (``model_runner.py`` load_model / initialize_kv_cache / sample_tokens)."""
    names = ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.model_runner",
             "vllm.v1.worker.gpu.states", "vllm.v1.worker.gpu.spec_decode", "vllm.v1.worker.gpu.spec_decode.ngram",
             "vllm.v1.worker.gpu.spec_decode.ngram.speculator", "torch")  # fmt: skip
    mods = {n: types.ModuleType(n) for n in names}
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    mr = mods["vllm.v1.worker.gpu.model_runner"]

    def init_speculator(vllm_config: Any, device: Any, req_states: Any) -> Any:
        return FakeDraftModelSpeculator()

    class RequestState:
        def __init__(self, max_num_reqs: int, use_dense_all_token_ids: bool = False) -> None:
            self.max_num_reqs = max_num_reqs
            self.req_id_to_index: dict[str, int] = {}

    class GPUModelRunner:
        def __init__(self) -> None:
            self.req_states = RequestState(8)
            cfg = types.SimpleNamespace(speculative_config=types.SimpleNamespace(use_eagle=lambda: True))
            self.speculator = mr.init_speculator(cfg, "cpu", self.req_states)
            if isinstance(self.speculator, FakeDraftModelSpeculator):
                self.speculator.load_model("target")
                self.speculator.set_attn("attention")
            self.speculator.pcp_manager = "pcp"

        def execute_model(self, scheduler_output: Any) -> Any:
            batch = types.SimpleNamespace(idx_mapping=np.array([0, 1], dtype=np.int64))
            return self.speculator.propose(batch, num_speculative_tokens=K)

    mr.init_speculator = init_speculator  # type: ignore[attr-defined]
    mr.GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
    mods["vllm.v1.worker.gpu.states"].RequestState = RequestState  # type: ignore[attr-defined]
    ngram_mod = mods["vllm.v1.worker.gpu.spec_decode.ngram.speculator"]

    class NgramGPUSpeculator(FakeNgram):
        def __init__(self, vllm_config: Any, device: Any, req_states: Any) -> None:
            pass

    ngram_mod.NgramGPUSpeculator = NgramGPUSpeculator  # type: ignore[attr-defined]
    torch = mods["torch"]
    torch.bool = bool  # type: ignore[attr-defined]
    torch.where = np.where  # type: ignore[attr-defined]
    torch.zeros = lambda n, dtype, device: np.zeros(n, dtype=dtype)  # type: ignore[attr-defined]
    return mr


def test_the_runner_loads_eagles_model_and_serves_merged_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the fix the runner held a plain wrapper: not a ``DraftModelSpeculator``, so EAGLE's model
    and attention were never set up and its first proposal raised out of the runner (the engine
    stopped); ``pcp_manager`` landed on the wrapper, not on EAGLE."""
    from controller.vllm.v2 import install_v2_runner

    mr = _fake_vllm(monkeypatch)
    assert install_v2_runner(ngram_min=1, ngram_max=3) is None
    runner = mr.GPUModelRunner()  # type: ignore[attr-defined]
    sp = runner.speculator
    assert isinstance(sp, FakeDraftModelSpeculator) and isinstance(sp, CompositeSpeculator)
    eagle = sp._eagle
    assert eagle.model == "draft of target" and eagle.attn == "attention" and eagle.pcp_manager == "pcp"
    runner.req_states.req_id_to_index.update({"a": 0, "b": 1})
    out = runner.execute_model(types.SimpleNamespace(**{NGRAM_ROWS_ATTR: frozenset({"b"})}))
    assert out.tolist() == [[100] * K, [200] * K]


def test_a_speculator_class_that_cannot_be_grafted_gets_the_plain_wrapper() -> None:
    class Slotted:
        __slots__ = ("x",)

        def propose(self, input_batch: Any, *a: Any, **kw: Any) -> Any:
            return np.full((len(input_batch.idx_mapping), K), 100, dtype=np.int64)

    slots = {"a": 2}
    got = v2.graft(
        Slotted(), ngram=FakeNgram(), mask=np.zeros(4, dtype=bool), req_id_to_index=slots, where=np.where
    )
    assert type(got) is CompositeSpeculator
    got.set_ngram_requests(types.SimpleNamespace(**{NGRAM_ROWS_ATTR: frozenset({"a"})}))
    out = got.propose(types.SimpleNamespace(idx_mapping=np.array([1, 2])))
    assert out.tolist() == [[100] * K, [200] * K]


def test_a_speculator_with_an_attribute_of_the_wrappers_names_is_left_as_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eagle = FakeDraftModelSpeculator()
    eagle.mask = "EAGLE's own"  # type: ignore[attr-defined]
    got = v2.graft(eagle, ngram=FakeNgram(), mask=np.zeros(4, dtype=bool), req_id_to_index={}, where=np.where)
    assert got is eagle and eagle.mask == "EAGLE's own"  # type: ignore[attr-defined]
    assert len(caplog.records) == 1 and "falling back" in caplog.records[0].getMessage()


def test_the_real_eagle_class_stays_a_draft_model_speculator() -> None:
    """vLLM's own classes (V2 runner): the grafted speculator passes the runner's type checks."""
    pytest.importorskip("torch", reason="vLLM's environment only")
    spec = pytest.importorskip("vllm.v1.worker.gpu.spec_decode.speculator", reason="vLLM's environment only")
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator  # type: ignore[import-not-found]

    eagle = EagleSpeculator.__new__(EagleSpeculator)
    sp = v2.graft(eagle, ngram=FakeNgram(), mask=np.zeros(4, dtype=bool), req_id_to_index={}, where=np.where)
    assert isinstance(sp, spec.DraftModelSpeculator) and isinstance(sp, CompositeSpeculator)
    sp.pcp_manager = "pcp"
    assert eagle.pcp_manager == "pcp"


def test_a_copy_of_the_wrapper_does_not_recurse() -> None:
    w = CompositeSpeculator(eagle=FakeNgram(), ngram=FakeNgram(), mask=np.zeros(4, dtype=bool),
                            req_id_to_index={}, where=np.where)  # fmt: skip
    assert copy.copy(w)._ngram is w._ngram


class _Eagle:
    def __init__(self) -> None:
        self.step = 0

    def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        self.step += 1
        n = len(input_batch.idx_mapping)
        g = torch.Generator().manual_seed(self.step)
        return torch.randint(0, I32, (n, K), generator=g, dtype=torch.int64)


class _Ngram(_Eagle):
    def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().propose(input_batch, *args, **kwargs)
        out[:, 0] = I32  # the int32 edge, and 0
        out[:, 1] = 0
        return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.sampled_from("abcdefgh"), unique=True, min_size=1, max_size=8),  # batch, in order
            st.sets(st.sampled_from("abcdefghz")),  # on n-gram (z: not in the batch)
            st.permutations(range(8)),  # slots this step (ids keep or change slot)
            st.sampled_from([None, 0, 1, K]),  # num_speculative_tokens
            st.booleans(),  # dummy run
        ),
        min_size=1,
        max_size=12,
    )
)
def test_merged_drafts_equal_the_reference_step_after_step(steps: list[Any]) -> None:
    torch = pytest.importorskip("torch", reason="vLLM's environment only")
    slots: dict[str, int] = {}
    eagle, ngram = _Eagle(), _Ngram()
    w = CompositeSpeculator(eagle=eagle, ngram=ngram, mask=torch.zeros(8, dtype=torch.bool),
                            req_id_to_index=slots, where=torch.where)  # fmt: skip
    for batch, on, perm, k, dummy in steps:
        slots.clear()
        slots.update({r: perm[i] for i, r in enumerate(batch)})
        w.set_ngram_requests(types.SimpleNamespace(**{NGRAM_ROWS_ATTR: frozenset(on)}))
        ib = types.SimpleNamespace(idx_mapping=torch.tensor([slots[r] for r in batch]))
        kw: dict[str, Any] = {"dummy_run": dummy}
        if k is not None:
            kw["num_speculative_tokens"] = k
        out = w.propose(ib, **kw)
        e = _Eagle()
        e.step = eagle.step - 1
        want_e = e.propose(ib)
        n = _Ngram()
        n.step = ngram.step - 1
        want_n = n.propose(ib) if ngram.step else None
        merge = bool(on) and not dummy and k != 0
        assert out.shape == (len(batch), K) and out.dtype == torch.int64
        for i, r in enumerate(batch):
            want = want_n[i] if merge and r in on and want_n is not None else want_e[i]
            assert out[i].tolist() == want.tolist(), (i, r)
