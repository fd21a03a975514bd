"""The V2-runner speculator wrapper against fakes (numpy arrays stand in for device tensors; the merge
is the same ``where(mask[idx_mapping, None], ngram, eagle)`` the engine runs with torch)."""

from __future__ import annotations

import logging
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.vllm.mode import NGRAM_ROWS_ATTR
from controller.vllm.v2 import CompositeSpeculator, merge_by_mask

K = 4


class FakeSpeculator:
    def __init__(self, fill: int, width: int = K) -> None:
        self.fill, self.width = fill, width
        self.calls: list[dict[str, Any]] = []
        self.draft_token_confidence_probs = "eagle's own attribute"

    def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        self.calls.append(kwargs)
        n = len(input_batch.idx_mapping)
        return np.arange(n * self.width).reshape(n, self.width) % 7 + self.fill


def _batch(slots: list[int]) -> Any:
    return types.SimpleNamespace(idx_mapping=np.array(slots, dtype=np.int64))


def _wrapper(
    slots: dict[str, int], ngram_width: int = K
) -> tuple[CompositeSpeculator, FakeSpeculator, FakeSpeculator]:
    eagle, ngram = FakeSpeculator(100), FakeSpeculator(200, ngram_width)
    w = CompositeSpeculator(
        eagle=eagle, ngram=ngram, mask=np.zeros(16, dtype=bool), req_id_to_index=slots, where=np.where
    )
    return w, eagle, ngram


def test_rows_on_ngram_by_slot_others_eagle_bit_for_bit() -> None:
    slots = {"a": 3, "b": 0, "c": 9}
    w, eagle, ngram = _wrapper(slots)
    batch = _batch([9, 3, 0])  # batch row i -> request-state slot
    w.set_ngram_requests(types.SimpleNamespace(**{NGRAM_ROWS_ATTR: frozenset({"a", "gone"})}))
    out = w.propose(batch, "attn", num_speculative_tokens=K)
    e = eagle.propose(batch)
    n = ngram.propose(batch)
    assert out[1].tolist() == n[1].tolist()  # a (slot 3) is batch row 1
    assert out[0].tolist() == e[0].tolist() and out[2].tolist() == e[2].tolist()
    assert ngram.calls[0] == {"num_speculative_tokens": K}  # same arguments as EAGLE's
    assert w.draft_token_confidence_probs == "eagle's own attribute"  # everything else is EAGLE's


def test_no_ngram_rows_dummy_runs_and_errors_pass_eagle_through() -> None:
    w, eagle, ngram = _wrapper({"a": 1})
    batch = _batch([1])
    assert w.propose(batch).tolist() == eagle.propose(batch).tolist() and not ngram.calls
    w.set_ngram_requests(types.SimpleNamespace(**{NGRAM_ROWS_ATTR: frozenset({"a"})}))
    assert w.propose(batch, dummy_run=True).tolist() == eagle.propose(batch).tolist() and not ngram.calls

    def boom(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("kernel failed")

    ngram.propose = boom  # type: ignore[method-assign]
    assert w.propose(batch).tolist() == eagle.propose(batch).tolist()
    ngram.propose = FakeSpeculator(200).propose  # type: ignore[method-assign]
    assert w.propose(batch).tolist() == eagle.propose(batch).tolist()  # stays off after an error


def test_a_step_asking_for_no_drafts_is_eagles_and_leaves_the_merge_on() -> None:
    """vLLM 0.33's V2 runner proposes with K = 0 where no request can use the drafts (skip_drafts)."""
    w, eagle, ngram = _wrapper({"a": 0})
    batch = _batch([0])
    w.set_ngram_requests(types.SimpleNamespace(**{NGRAM_ROWS_ATTR: frozenset({"a"})}))
    assert w.propose(batch, num_speculative_tokens=0).tolist() == eagle.propose(batch).tolist()
    assert not ngram.calls
    assert w.propose(batch, num_speculative_tokens=K).tolist() == ngram.propose(batch).tolist()


def test_wider_ngram_drafts_are_cut_to_eagles_width() -> None:
    w, _, _ = _wrapper({"a": 0}, ngram_width=K + 2)
    w.set_ngram_requests(types.SimpleNamespace(**{NGRAM_ROWS_ATTR: frozenset({"a"})}))
    assert w.propose(_batch([0])).shape == (1, K)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.data())
def test_merge_by_mask_property(n: int, k: int, data: st.DataObject) -> None:
    slots = data.draw(st.permutations(list(range(128))))[:n]
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=128, max_size=128)))
    eagle = np.random.default_rng(n).integers(0, 1000, (n, k))
    ngram = eagle + 1000
    out = merge_by_mask(eagle, ngram, mask, np.array(slots), np.where)
    for i, s in enumerate(slots):
        assert out[i].tolist() == (ngram if mask[s] else eagle)[i].tolist()


def test_tensor_parallel_ranks_hand_on_eagles_drafts_once_any_rank_failed() -> None:
    """Ranks must verify the same drafts (``controller.vllm.ranks``): with a peer whose merge failed,
    this rank hands on EAGLE's; once this rank's merge failed, it tells its peers on every step with
    n-gram rows (and joins no collective on a step without)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (it runs in vLLM's environment)")
    from tests.controller.vllm.fakes import PeerGroup

    class TorchSpeculator(FakeSpeculator):
        def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
            return torch.from_numpy(super().propose(input_batch, *args, **kwargs))

    rows = types.SimpleNamespace(**{NGRAM_ROWS_ATTR: frozenset({"a"})})
    for peer_failed in (False, True):
        eagle, ngram = TorchSpeculator(100), TorchSpeculator(200)
        w = CompositeSpeculator(eagle=eagle, ngram=ngram, mask=torch.zeros(4, dtype=torch.bool),
                                req_id_to_index={"a": 1}, where=torch.where)  # fmt: skip
        w._speccontrol_tp = group = PeerGroup(peer_failed)  # type: ignore[attr-defined]
        w.set_ngram_requests(rows)
        batch = types.SimpleNamespace(idx_mapping=torch.tensor([1]))
        out = w.propose(batch)
        assert out.tolist() == (eagle if peer_failed else ngram).propose(batch).tolist()
        assert group.flags == [0.0]
    w._ngram = None  # type: ignore[assignment]  # this rank's merge now fails
    assert w.propose(batch).tolist() == eagle.propose(batch).tolist()
    assert w.propose(batch).tolist() == eagle.propose(batch).tolist()
    assert group.flags == [0.0, 1.0, 1.0]
    w.set_ngram_requests(types.SimpleNamespace())
    w.propose(batch)
    assert group.flags == [0.0, 1.0, 1.0]


class _FakeRequestState:
    """vLLM's V2 ``RequestState``: the dense history is a device allocation that can fail."""

    def __init__(
        self, max_num_reqs: int, *, use_dense_all_token_ids: bool = False, oom: bool = False
    ) -> None:
        if use_dense_all_token_ids and oom:
            raise RuntimeError("CUDA out of memory (test)")
        self.max_num_reqs, self.dense = max_num_reqs, use_dense_all_token_ids
        self.req_id_to_index: dict[str, int] = {}


def _fake_v2_vllm(monkeypatch: pytest.MonkeyPatch, *, ngram_raises: bool) -> dict[str, types.ModuleType]:
    """Just the modules ``install_v2_runner`` patches (and a torch with what it calls), so this runs
    without vLLM or torch."""
    import sys

    names = ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.model_runner",
             "vllm.v1.worker.gpu.states", "vllm.v1.worker.gpu.spec_decode", "vllm.v1.worker.gpu.spec_decode.ngram",
             "vllm.v1.worker.gpu.spec_decode.ngram.speculator", "torch")  # fmt: skip
    mods = {n: types.ModuleType(n) for n in names}
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    eagle = types.SimpleNamespace(name="vLLM's own speculator")

    def init_speculator(vllm_config: Any, device: Any, req_states: Any) -> Any:
        return eagle

    class GPUModelRunner:
        def execute_model(self, scheduler_output: Any) -> None:
            return None

    class NgramGPUSpeculator:
        def __init__(self, vllm_config: Any, device: Any, req_states: Any) -> None:
            if ngram_raises:
                raise RuntimeError("ngram_gpu speculative decoding requires Triton.")

    mr, st_, sp, torch = (mods["vllm.v1.worker.gpu.model_runner"], mods["vllm.v1.worker.gpu.states"],
                          mods["vllm.v1.worker.gpu.spec_decode.ngram.speculator"], mods["torch"])  # fmt: skip
    mr.init_speculator = init_speculator  # type: ignore[attr-defined]
    mr.GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
    st_.RequestState = type("RequestState", (_FakeRequestState,), {})  # type: ignore[attr-defined]
    sp.NgramGPUSpeculator = NgramGPUSpeculator  # type: ignore[attr-defined]
    torch.bool = bool  # type: ignore[attr-defined]
    torch.where = np.where  # type: ignore[attr-defined]
    torch.zeros = lambda n, dtype, device: np.zeros(n, dtype=dtype)  # type: ignore[attr-defined]
    return mods


def _eagle_config() -> Any:
    return types.SimpleNamespace(speculative_config=types.SimpleNamespace(use_eagle=lambda: True))


@pytest.mark.parametrize("ngram_raises", [False, True])
def test_an_error_building_the_ngram_speculator_keeps_vllms_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, ngram_raises: bool
) -> None:
    """The patched ``init_speculator`` runs inside vLLM's runner constructor: an exception there (no
    Triton, an assert, a device allocation) would stop the engine from starting. It must fall back to
    vLLM's own speculator with one log line instead."""
    from controller.vllm.v2 import install_v2_runner

    mods = _fake_v2_vllm(monkeypatch, ngram_raises=ngram_raises)
    assert install_v2_runner(ngram_min=1, ngram_max=3) is None
    mr = mods["vllm.v1.worker.gpu.model_runner"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.speccontrol"):
        sp = mr.init_speculator(_eagle_config(), "cpu", _FakeRequestState(4))  # type: ignore[attr-defined]
    if not ngram_raises:
        assert isinstance(sp, CompositeSpeculator) and not caplog.records
        return
    assert sp.name == "vLLM's own speculator"  # returned unchanged
    assert len(caplog.records) == 1 and "falling back" in caplog.records[0].getMessage()
    assert "requires Triton" in caplog.records[0].getMessage()


def test_a_dense_history_that_cannot_be_allocated_falls_back_to_vllms(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The dense history (max_num_seqs x max_model_len x 4 bytes) is allocated in the runner's
    constructor before vLLM profiles memory; failing to allocate it must leave vLLM's own history."""
    from controller.vllm.v2 import install_v2_runner

    mods = _fake_v2_vllm(monkeypatch, ngram_raises=False)
    assert install_v2_runner(ngram_min=1, ngram_max=3) is None
    RequestState = mods["vllm.v1.worker.gpu.states"].RequestState  # type: ignore[attr-defined]
    assert RequestState(4).dense  # the install turns it on
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.speccontrol"):
        rs = RequestState(4, oom=True)
    assert rs.max_num_reqs == 4 and not rs.dense
    assert len(caplog.records) == 1 and "falling back" in caplog.records[0].getMessage()
