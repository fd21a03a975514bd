"""``controller.vllm.ranks``: tensor-parallel ranks hand on the same drafts (a fake group; the real one
runs in ``tests/e2e/test_vllm_tp.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (it runs in vLLM's environment)")

from controller.vllm.ranks import agree, tensor_parallel_group  # noqa: E402
from tests.controller.vllm.fakes import PeerGroup  # noqa: E402


def _drafts(rows: int, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """EAGLE's drafts and the merged ones (every other row n-gram's), vocabulary ids up to 2**31 - 1."""
    eagle = [[2**31 - 1 - r] * k for r in range(rows)]
    return eagle, [[r * k + i for i in range(k)] if r % 2 == 0 else eagle[r] for r in range(rows)]


@pytest.mark.parametrize("peer_failed", [False, True])
@pytest.mark.parametrize("failed", [False, True])
@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize(("rows", "k"), [(2, 2), (512, 8)])
def test_the_merged_drafts_only_when_no_rank_failed(
    peer_failed: bool, failed: bool, as_tensor: bool, rows: int, k: int
) -> None:
    group = PeerGroup(peer_failed)
    eagle, merged_rows = _drafts(rows, k)
    drafts, merged = (torch.tensor(eagle), torch.tensor(merged_rows)) if as_tensor else (eagle, merged_rows)
    out = agree(group, drafts if failed else merged, drafts, failed=failed, device="cpu")
    got = out.tolist() if as_tensor else out
    assert got == (eagle if failed or peer_failed else merged_rows)
    assert group.flags == [float(failed)]  # every rank joins, the failed one too


def test_a_collective_that_fails_hands_on_eagles_drafts(caplog: pytest.LogCaptureFixture) -> None:
    eagle, merged = _drafts(2, 2)
    drafts = torch.tensor(eagle)
    assert agree(PeerGroup(raises=True), torch.tensor(merged), drafts, failed=False, device="cpu") is drafts
    assert any("could not agree" in r.getMessage() for r in caplog.records)


def test_the_group_is_looked_up_once_and_a_single_rank_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm.distributed", reason="vLLM is not installed")
    import vllm.distributed

    groups = iter([SimpleNamespace(world_size=1), PeerGroup()])
    monkeypatch.setattr(vllm.distributed, "get_tp_group", lambda: next(groups))
    single, tp = SimpleNamespace(), SimpleNamespace()
    assert tensor_parallel_group(single) is None and tensor_parallel_group(single) is None
    g = tensor_parallel_group(tp)
    assert isinstance(g, PeerGroup) and tensor_parallel_group(tp) is g  # (the iterator is spent)


def test_outside_an_engine_there_is_no_group() -> None:
    assert tensor_parallel_group(SimpleNamespace()) is None
