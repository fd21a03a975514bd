"""Hostile checks of the worker's n-gram drafters (``device_ngram.DeviceDrafter``, ``worker.DraftMerger``)
against a plain-python reference of the intended semantics: each request's history is its known tokens
(non-negative, cut at ``max_model_len``) plus every valid sampled token of every step it took part in
(not discarded), rebuilt on a restart, new on an id reused in the same step; a row on n-gram is vLLM's
rule (``match_ngram``) on that history, padded with its last token to the drafts' width, else EAGLE's.
Also: the torch path's match holds a bounded slice of a large batch at once."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is imported: kernels on CPU tensors
torch = pytest.importorskip("torch", reason="torch is not installed (it runs in vLLM's environment)")

from controller.vllm import device_ngram  # noqa: E402
from controller.vllm.device_ngram import DeviceDrafter  # noqa: E402
from controller.vllm.worker import DraftMerger  # noqa: E402
from policies.prompt_lookup import match_ngram  # noqa: E402

I32 = (1 << 31) - 1
VOCAB = [0, 1, 2, I32]  # token ids 0 and the int32 edge


def _reference(
    hist: list[int], on: bool, k_cols: int, eagle_row: list[int], cfg: dict[str, int]
) -> list[int]:
    if not on or k_cols == 0:
        return eagle_row
    d = match_ngram(np.array(hist, dtype=np.int64), cfg["min_n"], cfg["max_n"], cfg["max_model_len"],
                    cfg["max_k"]).tolist()  # fmt: skip
    return (d + [d[-1]] * k_cols)[:k_cols] if d else eagle_row


@pytest.mark.usefixtures("kernels")  # the host drafter as plain Python, then compiled
@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 3, 64, 1 << 21]))
def test_every_drafter_equals_the_reference_under_churn(seed: int, cells: int) -> None:
    """Requests finishing (their ids reused in the same step), restarting, prefilling (discarded rows),
    rows flipping on and off n-gram, K of 0, 1, max and above max, histories at ``max_model_len``, and
    the torch path's match in groups of any size (``_MATCH_CELLS``)."""
    rng = np.random.default_rng(seed)
    cfg = {"max_k": int(rng.integers(1, 6)), "min_n": int(rng.integers(1, 3)),
           "max_model_len": int(rng.choice([3, 7, 20, 60]))}  # fmt: skip
    cfg["max_n"] = cfg["min_n"] + int(rng.integers(0, 3))
    mml, max_k = cfg["max_model_len"], cfg["max_k"]
    mp = pytest.MonkeyPatch()
    mp.setattr(device_ngram, "_MATCH_CELLS", cells, raising=False)
    try:
        drafters: dict[str, Any] = {"host": DraftMerger(**cfg), "torch": DeviceDrafter(**cfg, device="cpu"),
                                    "deferred": DraftMerger(**cfg)}  # fmt: skip
        known: dict[str, list[int]] = {}
        hist: dict[str, list[int]] = {}
        live: list[str] = []
        fresh = iter(range(10**6))
        for _ in range(25):
            finished, restarted = [], []
            for r in list(live):
                if rng.random() < 0.15:
                    live.remove(r)
                    finished.append(r)
                    hist.pop(r, None)
                    if rng.random() < 0.5:  # the same id again, in the same step
                        live.append(r)
                        known[r] = [int(x) for x in rng.choice(VOCAB, int(rng.integers(0, mml + 3)))]
            while len(live) < int(rng.integers(1, 8)):
                r = f"r{next(fresh)}"
                live.append(r)
                known[r] = [int(x) for x in rng.choice([*VOCAB, -1], int(rng.integers(0, mml + 3)))]
            for r in live:
                if r in hist and rng.random() < 0.05:  # preempted and resumed: rebuilt from what it knows
                    restarted.append(r)
                    known[r] = list(hist.pop(r))
            ids = list(rng.permutation(live))
            n = len(ids)
            stepped = int(rng.integers(0, n + 1))
            sampled = rng.choice([*VOCAB, -1], (stepped, int(rng.integers(0, max_k + 2)))).astype(np.int64)
            disc = rng.random(n + 3) < 0.15
            cols = int(rng.choice([0, 1, max_k, max_k + 2]))
            eagle = rng.integers(0, I32, (n, cols), dtype=np.int64)
            on = {r for r in ids if rng.random() < 0.5}
            kw = {"discarded": disc, "finished": finished, "restarted": restarted}
            got = {
                "host": drafters["host"].step(ids, sampled, eagle, on, known.get, **kw),
                "deferred": drafters["deferred"].step_deferred(
                    ids, sampled.copy(), eagle, on, known.get, **kw
                ),
                "torch": drafters["torch"].step(
                    ids, torch.from_numpy(sampled), torch.from_numpy(eagle), on, known.get, **kw
                ),
            }
            for j, r in enumerate(ids):
                if j < stepped and not disc[j]:
                    if r not in hist:
                        hist[r] = [x for x in known[r] if x >= 0][:mml]
                    hist[r] = (hist[r] + [int(x) for x in sampled[j] if x >= 0])[:mml]
            want = [_reference(hist.get(r, []), r in on and r in hist, cols, eagle[j].tolist(), cfg)
                    for j, r in enumerate(ids)]  # fmt: skip
            for name, out in got.items():
                rows = eagle if out is None else (out.numpy() if torch.is_tensor(out) else out)
                assert rows.shape == eagle.shape and rows.dtype == eagle.dtype, name
                assert rows.tolist() == want, name
    finally:
        mp.undo()


def test_the_match_holds_a_bounded_slice_of_the_batch_at_once() -> None:
    """256 rows on n-gram with 32k-token histories: the torch path's match used to build its
    (rows x history x max_n) comparison for the whole batch at once, about 90 bytes per row and
    position (3 GiB for 1024 rows of 32k tokens, 12 GiB at 128k), an allocation that fails on a GPU
    whose memory vLLM gave to the KV cache. Run on torch's ``meta`` device (shapes only): no operation
    of a step makes a tensor larger than a fixed bound."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rows, length, max_n = 256, 32_000, 5
    d = DeviceDrafter(max_k=5, min_n=1, max_n=max_n, max_model_len=length + 64, device="meta")
    prompt = np.arange(length, dtype=np.int64) % 1000
    ids = [f"r{i}" for i in range(rows)]
    d.step(ids, torch.zeros((rows, 0), dtype=torch.int64, device="meta"), None, (), lambda r: prompt)

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if torch.is_tensor(t) and t._base is None:  # a new allocation, not a view
                    Largest.largest = max(Largest.largest, t.numel())
            return out

    drafts = torch.zeros((rows, 5), dtype=torch.int64, device="meta")
    with Largest():
        out = d.step(
            ids, torch.ones((rows, 2), dtype=torch.int64, device="meta"), drafts, set(ids), dict().get
        )
    assert out is not None and out.shape == drafts.shape
    assert Largest.largest <= (1 << 21) * (max_n + 1), Largest.largest  # the whole batch: 41 M
