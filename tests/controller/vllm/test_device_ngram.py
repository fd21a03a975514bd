"""The worker's n-gram drafter on the device (``DeviceDrafter``) against the host one (``DraftMerger``):
the same drafts and histories call after call, with torch's operations and with the Triton kernels
(``device_kernels``, in Triton's interpreter on CPU tensors), and no device value read on the host
(every step also runs on torch's ``meta`` device, which has no data to read)."""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Triton reads this when it is imported: its kernels then run on CPU tensors (vLLM's environment has it).
os.environ.setdefault("TRITON_INTERPRET", "1")
torch = pytest.importorskip("torch", reason="torch is not installed (it runs in vLLM's environment)")
TRITON = importlib.util.find_spec("triton") is not None

from controller.vllm.device_ngram import DeviceDrafter  # noqa: E402
from controller.vllm.worker import DraftMerger  # noqa: E402
from tests.controller.vllm.fakes import PeerGroup  # noqa: E402
from tests.controller.vllm.strategies import BatchStep, batch_steps  # noqa: E402

pytestmark = pytest.mark.usefixtures("kernels")
K = 4


class _Both:
    """The host drafter, the device one on CPU torch and one on ``meta``, driven with the same calls."""

    def __init__(
        self, *, min_n: int = 1, max_n: int = 3, max_model_len: int = 1 << 20, triton: bool = True
    ) -> None:
        kw = {"max_k": K, "min_n": min_n, "max_n": max_n, "max_model_len": max_model_len}
        self.host = DraftMerger(**kw)
        self.dev = DeviceDrafter(**kw, device="cpu")
        self.meta = DeviceDrafter(**kw, device="meta")
        self.tri = DeviceDrafter(**kw, device="cpu", kernels="triton") if TRITON and triton else None

    def step(self, ids: Sequence[str], sampled: np.ndarray, eagle: np.ndarray, on: set[str],
             known: Callable[[str], Sequence[int] | None], **kw: Any) -> None:  # fmt: skip
        want = self.host.step(ids, sampled, eagle, on, known, **kw)
        got = self.dev.step(ids, torch.from_numpy(sampled), torch.from_numpy(eagle), on, known, **kw)
        self.meta.step(ids, torch.from_numpy(sampled).to("meta"), torch.from_numpy(eagle).to("meta"), on, known,
                       **kw)  # fmt: skip
        assert (eagle if want is None else want).tolist() == (eagle if got is None else got.numpy()).tolist()
        assert got is None or got.dtype == torch.int64  # the drafts' own dtype
        if self.tri is not None:
            tri = self.tri.step(ids, torch.from_numpy(sampled), torch.from_numpy(eagle), on, known, **kw)
            assert (eagle if want is None else want).tolist() == (
                eagle if tri is None else tri.numpy()
            ).tolist()
            assert tri is None or tri.dtype == torch.int64

    def same_histories(self) -> None:
        self.dev.flush()  # the appends of steps without n-gram rows may wait
        self.meta.flush()
        if self.tri is not None:
            self.tri.flush()
            assert set(self.tri._slot) == set(self.dev._slot)
            for r, d in self.dev._slot.items():
                n, t = int(self.dev._len[d]), self.tri._slot[r]
                assert int(self.tri._len[t]) == n
                assert self.tri._hist[t, :n].tolist() == self.dev._hist[d, :n].tolist()
        assert set(self.host._slot) == set(self.dev._slot)
        for r, s in self.host._slot.items():
            d = self.dev._slot[r]
            n = int(self.dev._len[d])
            # (a request never outgrows max_model_len; the host keeps what a test sends beyond it)
            want = self.host._index.tokens(s)[: self.dev.max_model_len].tolist()
            assert want == self.dev._hist[d, :n].tolist()
            assert n <= self.dev._bound[d]
        # device memory follows the longest history (doubling from 256 columns), not max_model_len
        longest = max((int(self.dev._bound[d]) for d in self.dev._slot.values()), default=0)
        assert self.dev._hist.shape[1] == self.dev._cols + 1 and self.dev._cols <= max(256, 2 * longest)


def _rows(*rows: list[int]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(len(rows), -1)


def test_rows_on_ngram_replaced_others_kept_short_drafts_padded() -> None:
    d = DeviceDrafter(max_k=K, min_n=1, max_n=3, max_model_len=1 << 20, device="cpu")
    prompts = {"a": [5, 6, 7, 5, 6], "b": [1, 2, 3], "c": [9, 8]}
    eagle = torch.full((3, K), 100, dtype=torch.int64)
    sampled = torch.tensor([[7, -1, -1], [4, -1, -1], [9, -1, -1]])
    out = d.step(["a", "b", "c"], sampled, eagle, {"a", "b", "c"}, prompts.get)
    assert out is not None
    assert out.tolist() == [[5, 6, 7, 7], [100] * K, [8, 9, 9, 9]]  # as DraftMerger's own test
    assert eagle.tolist() == [[100] * K] * 3  # the input is not modified
    assert d.step(["a", "b", "c"], sampled[:0], eagle, set(), prompts.get) is None  # no row on n-gram


@settings(max_examples=80, deadline=None)
@given(
    batch_steps(K),
    st.integers(1, 3),
    st.sampled_from([8, 12, 1 << 20]),  # max_model_len: small ones cut drafts and histories
)
def test_the_device_drafter_gives_the_host_drafters_drafts(
    steps: list[BatchStep], min_n: int, max_model_len: int
) -> None:
    """Requests arriving, finishing, restarting, prefilling, not stepping; rows on n-gram changing every
    step; histories reaching ``max_model_len``: the same drafts at every step, the same histories."""
    both = _Both(min_n=min_n, max_n=min_n + 2, max_model_len=max_model_len)
    pool = [f"r{i}" for i in range(6)]
    clock = [0]

    def known(r: str) -> list[int] | None:
        if r == "r5":
            return None  # prompt embeddings: never tracked
        # prompts of 0..4 tokens: the shortest histories draft nothing
        return [int(r[1:]) % 3, 1, int(r[1:]) % 2, 1, clock[0] % 3][: (int(r[1:]) + clock[0]) % 5]

    for rows, on_bits, skip_bits, fin_bits, re_bits, n, stepped in steps:
        ids = pool[:n]
        finished = [r for i, r in enumerate(pool) if fin_bits >> i & 1 and r not in ids]
        restarted = [r for i, r in enumerate(ids) if re_bits >> i & 1]
        on = {r for i, r in enumerate(ids) if on_bits >> i & 1}
        mask = np.array([bool(skip_bits >> i & 1) for i in range(n)])
        eagle = np.full((n, K), -7, dtype=np.int64)
        sampled = np.array(rows[: min(n, stepped)], dtype=np.int64).reshape(-1, K + 1)
        both.step(ids, sampled, eagle, on, known, discarded=mask,
                  finished=finished, restarted=restarted)  # fmt: skip
        clock[0] += 1
    both.same_histories()


def test_the_device_drafter_at_serving_sizes(kernels: str) -> None:
    """128 rows, 1,000-token repetitive prompts, 60 steps, a request replaced in some row every step but
    in steps 20-49, vocabulary ids up to 2**31 - 1 (int32 histories), rows on n-gram changing every step
    but in steps 20-49, which have none (their appends wait: up to 16 steps, or until a request leaves)."""
    rng = np.random.default_rng(11)
    both = _Both(min_n=3, max_n=5, triton=kernels == "numba")  # (Triton's interpreter is slow: once)
    rows, width = 128, K + 1
    phrase = rng.integers(0, 2**31 - 1, 40)
    prompts: dict[str, list[int]] = {}

    def known(r: str) -> list[int]:
        if r not in prompts:
            mix = rng.random(1000) < 0.5
            prompts[r] = np.where(mix, rng.integers(0, 2**31 - 1, 1000), np.resize(phrase, 1000)).tolist()
        return prompts[r]

    ids = [f"r{i}" for i in range(rows)]
    fresh, finished = rows, []
    for t in range(60):
        sampled = np.where(rng.random((rows, width)) < 0.6, np.resize(phrase, (rows, width)), -1)
        sampled[:, 0] = phrase[t % 40]
        quiet = 20 <= t < 50
        on = set() if quiet else {r for r in ids if rng.random() < 0.5}
        both.step(ids, sampled, np.full((rows, K), -7, dtype=np.int64), on, known, finished=finished)
        finished = []
        if quiet and t != 37:  # (one request leaves after step 37: the waiting appends run first)
            continue
        gone = int(rng.integers(rows))
        finished = [ids[gone]]
        ids[gone] = f"r{fresh}"
        fresh += 1
    both.same_histories()
    assert len(both.dev) == rows


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        DeviceDrafter(max_k=K, min_n=4, max_n=3, max_model_len=64, device="cpu")
    with pytest.raises(ValueError, match="kernels must be one of torch, triton"):
        DeviceDrafter(max_k=K, min_n=1, max_n=3, max_model_len=64, device="cpu", kernels="cuda")
    if TRITON:
        with pytest.raises(ValueError, match="not on meta"):
            DeviceDrafter(max_k=K, min_n=1, max_n=3, max_model_len=64, device="meta", kernels="triton")


def _needs_triton() -> None:
    if not TRITON:
        pytest.skip("triton is not installed here (vLLM's environment has it)")
    from controller.vllm.device_kernels import interpreted

    assert interpreted(), "triton was imported before this module set TRITON_INTERPRET=1"


@pytest.mark.parametrize("min_n,max_n,max_k", [(1, 3, K), (4, 5, 1), (2, 8, 7)])
def test_the_triton_kernels_pass_their_own_start_check(min_n: int, max_n: int, max_k: int) -> None:
    from controller.vllm.device_ngram import triton_problem

    _needs_triton()
    assert triton_problem("cpu", max_k=max_k, min_n=min_n, max_n=max_n) is None


@pytest.mark.parametrize("broken", ["match", "append"])
def test_the_start_check_refuses_kernels_that_differ(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that drafts nothing, or appends nothing, is caught before any serving step uses it; so
    is one that raises (a compiler or driver error), with the error's first line."""
    from controller.vllm import device_kernels
    from controller.vllm.device_ngram import triton_problem

    _needs_triton()
    name = f"{broken}_rows"
    monkeypatch.setattr(device_kernels, name, lambda *a, **k: None)
    assert "differ" in (triton_problem("cpu", max_k=K, min_n=1, max_n=3) or "")

    def fails(*a: Any, **k: Any) -> None:
        raise RuntimeError("ptxas fatal: no such GPU\nmore")

    monkeypatch.setattr(device_kernels, name, fails)
    assert (
        triton_problem("cpu", max_k=K, min_n=1, max_n=3)
        == "a launch failed: RuntimeError: ptxas fatal: no such GPU"
    )


@pytest.mark.parametrize("broken", ["int32 tokens", "wide appends"])
def test_the_start_check_runs_the_appends_serving_runs(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM samples int32 tokens, and the appends of steps without n-gram rows wait and run as one, wider
    than one block of the kernel: an append broken only there was not caught (the check sampled int64,
    a step at a time)."""
    from controller.vllm import device_kernels
    from controller.vllm.device_ngram import triton_problem

    _needs_triton()
    real = device_kernels.append_rows

    def append(hist: Any, lens: Any, tok: Any, slots: Any, max_model_len: int) -> None:
        bad = (
            tok.dtype == torch.int32
            if broken == "int32 tokens"
            else tok.shape[1] > device_kernels.APPEND_BLOCK
        )
        real(hist, lens, tok[:, :1] if bad else tok, slots, max_model_len)  # (drops all but the first token)

    monkeypatch.setattr(device_kernels, "append_rows", append)
    assert "from the torch path's" in (triton_problem("cpu", max_k=K, min_n=1, max_n=3) or "")


def test_kernels_that_fail_while_serving_leave_the_drafter_on_torchs_operations(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A variant first compiled while serving (a dtype or width the start check did not meet) that fails
    cost the runner its n-gram drafts for good (the worker disables a drafter that raises); now the
    drafter redoes the step with torch's operations and keeps them."""
    from controller.vllm import device_kernels

    _needs_triton()

    def fails(*a: Any, **k: Any) -> None:
        raise RuntimeError("out of resources: shared memory")

    both = _Both()
    assert both.tri is not None
    prompts = {"a": [5, 6, 7, 5, 6], "b": [1, 2, 3]}
    eagle = np.full((2, K), -7, dtype=np.int64)
    both.step(["a", "b"], _rows([7], [4]), eagle, {"a"}, prompts.get)
    monkeypatch.setattr(device_kernels, "match_rows", fails)
    with caplog.at_level(logging.WARNING, logger="vllm.speccontrol"):
        both.step(
            ["a", "b"], _rows([5], [1]), eagle, {"a", "b"}, prompts.get
        )  # the same drafts as the others
    assert both.tri.kernels == "torch" and both.tri.failure == "RuntimeError: out of resources: shared memory"
    assert "the Triton kernels failed (RuntimeError: out of resources: shared memory)" in caplog.text
    both.step(["a", "b"], _rows([6], [2]), eagle, {"b"}, prompts.get)
    both.same_histories()


def test_the_worker_uses_triton_where_asked_and_torch_where_its_check_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from controller.vllm import device_ngram, worker

    _needs_triton()
    runner = _runner("cpu", ["a"], {"a": [1, 2, 1]})
    assert (
        worker._new_drafter(runner, max_k=K, min_n=1, max_n=3, where="device", kernels="triton").kernels
        == "triton"
    )
    # auto: Triton only on CUDA (this is CPU); torch: never
    for kernels in ("auto", "torch"):
        assert (
            worker._new_drafter(runner, max_k=K, min_n=1, max_n=3, where="device", kernels=kernels).kernels
            == "torch"
        )
    monkeypatch.setattr(device_ngram, "triton_problem", lambda *a, **k: "triton cannot be imported (x)")
    with caplog.at_level(logging.WARNING, logger="vllm.speccontrol"):
        d = worker._new_drafter(runner, max_k=K, min_n=1, max_n=3, where="device", kernels="triton")
    assert d.kernels == "torch"
    assert "not Triton's kernels: triton cannot be imported (x)" in caplog.text


def _runner(device: str, ids: list[str], prompts: dict[str, list[int]]) -> Any:
    from types import SimpleNamespace as NS

    return NS(device=torch.device(device), max_model_len=1 << 20, input_batch=NS(req_ids=ids),
              discard_request_mask=None,
              requests={r: NS(prompt_token_ids=p, output_token_ids=[]) for r, p in prompts.items()})  # fmt: skip


@pytest.mark.parametrize("where", ["device", "host", "auto"])
def test_the_runner_gets_the_drafter_asked_for_and_its_own_types_back(where: str) -> None:
    """``SPECCONTROL_WORKER_NGRAM``: device, host, or auto (device only on CUDA, so host here); the
    merged drafts come back as the runner gave them (tensor, array or list), through ``_merge_step``."""
    from types import SimpleNamespace as NS

    from controller.vllm import worker
    from controller.vllm.mode import NGRAM_ROWS_ATTR

    prompts = {"a": [5, 6, 7, 5, 6], "b": [1, 2, 3]}
    runner = _runner("cpu", ["a", "b"], prompts)
    drafter = worker._new_drafter(runner, max_k=K, min_n=1, max_n=3, where=where)
    assert isinstance(drafter, DeviceDrafter if where == "device" else DraftMerger)
    so = NS(finished_req_ids=(), scheduled_cached_reqs=None, **{NGRAM_ROWS_ATTR: {"a"}})
    eagle = [[100] * K, [100] * K]
    # The sampled tokens as a tensor, or (vLLM's disable_padded_drafter_batch) as ragged lists.
    sampled_as = (torch.tensor([[7, -1], [4, -1]]), [[7], [4]])
    kinds = ((torch.tensor(eagle), torch.Tensor), (np.array(eagle), np.ndarray), (eagle, list))
    for (drafts, kind), sampled in itertools.product(kinds, sampled_as):
        runner.requests = {r: NS(prompt_token_ids=p, output_token_ids=[]) for r, p in prompts.items()}
        d = worker._new_drafter(runner, max_k=K, min_n=1, max_n=3, where=where)
        out = worker._merge_step(runner, d, so, sampled, drafts)
        assert isinstance(out, kind)
        got = out.tolist() if not isinstance(out, list) else out
        assert got == [[5, 6, 7, 7], [100] * K], kind


def test_a_step_without_ngram_rows_hands_back_the_runners_own_drafts() -> None:
    from types import SimpleNamespace as NS

    from controller.vllm import worker

    runner = _runner("cpu", ["a"], {"a": [1, 2, 1]})
    d = worker._new_drafter(runner, max_k=K, min_n=1, max_n=3, where="device")
    eagle = torch.full((1, K), 3)
    so = NS(finished_req_ids=(), scheduled_cached_reqs=None)
    assert worker._merge_step(runner, d, so, torch.tensor([[2]]), eagle) is eagle
    d.flush()  # (the append of a step without n-gram rows waits for the next that has some)
    assert len(d) == 1 and int(d._len[0]) == 4  # the history took the step's token all the same


def test_steps_without_ngram_rows_queue_one_copy_and_their_appends_run_as_one() -> None:
    """On a GPU every tensor operation is a launch: a step without n-gram rows (of the batch last seen)
    only copies its tokens, and the next step with n-gram rows appends all the waiting steps at once
    (the ATen calls counted with a dispatch mode, which sees every operation the drafter queues)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    both = _Both()
    ids, prompts = ["a", "b"], {"a": [1, 2, 3, 1, 2], "b": [7, 8, 7]}
    eagle = np.full((2, K), -7, dtype=np.int64)
    both.step(ids, _rows([3], [8]), eagle, {"a"}, prompts.get)  # the batch's slots are on the device now

    def step(sampled: np.ndarray, on: set[str]) -> list[str]:
        """One step of every drafter; the ATen calls of the device one."""
        tok, dev_eagle = torch.from_numpy(sampled), torch.from_numpy(eagle)
        with Ops() as ops:
            both.dev.step(ids, tok, dev_eagle, on, prompts.get)
        both.host.step(ids, sampled, eagle, on, prompts.get)
        both.meta.step(ids, tok.to("meta"), dev_eagle.to("meta"), on, prompts.get)
        if both.tri is not None:
            with Ops() as tri_ops:
                both.tri.step(ids, tok, dev_eagle, on, prompts.get)
            tri_names.append([n for n in tri_ops.names if n not in ("slice", "alias", "view", "detach")])
        return [n for n in ops.names if n not in ("slice", "alias", "view", "detach")]

    tri_names: list[list[str]] = []

    assert [step(_rows([1 + t], [7 + t]), set()) for t in range(3)] == [["clone"]] * 3
    names = step(_rows([2], [9]), {"a"})
    assert names.count("cat") == 1 and names.count("cumsum") == 1, names  # one append for four steps
    both.same_histories()
    # No more than _DEFER steps wait: the next one appends them.
    from controller.vllm.device_ngram import _DEFER

    runs = [step(_rows([t % 5], [-1 if t % 3 else 4]), set()) for t in range(2 * _DEFER + 1)]
    assert [i for i, names in enumerate(runs) if "cumsum" in names] == [_DEFER, 2 * _DEFER], runs
    both.same_histories()
    if both.tri is not None:  # the same steps with the Triton kernels: the append and the match are theirs
        # (the interpreter adds its own copies of the launch's arguments: empty, set_, copy_)
        assert [names for names in tri_names if names != ["clone"]] == [
            names for names in tri_names if "cat" in names
        ]  # a step without n-gram rows: one copy, as with torch's operations
        torch_path = {"cumsum", "cumprod", "amax", "gather", "where", "index_put_", "index", "minimum"}
        assert not torch_path & set(itertools.chain.from_iterable(tri_names)), tri_names


def test_the_runner_step_reads_nothing_on_the_host() -> None:
    """``_merge_step`` with the runner's tensors on ``meta`` (no data): any host read would raise."""
    from types import SimpleNamespace as NS

    from controller.vllm import worker
    from controller.vllm.mode import NGRAM_ROWS_ATTR

    runner = _runner("meta", ["a", "b"], {"a": [5, 6, 7, 5, 6], "b": [1, 2, 3]})
    d = worker._new_drafter(runner, max_k=K, min_n=1, max_n=3, where="auto")
    assert isinstance(d, DraftMerger)  # auto: the device drafter only on CUDA
    d = worker._new_drafter(runner, max_k=K, min_n=1, max_n=3, where="device")
    for on in ({"a"}, set(), {"a", "b"}):
        so = NS(finished_req_ids=(), scheduled_cached_reqs=None, **{NGRAM_ROWS_ATTR: on})
        sampled = torch.zeros((2, K + 1), dtype=torch.int64, device="meta")
        out = worker._merge_step(
            runner, d, so, sampled, torch.zeros((2, K), dtype=torch.int32, device="meta")
        )
        assert out.device.type == "meta" and tuple(out.shape) == (2, K) and out.dtype == torch.int32


def test_one_token_histories_and_steps_that_sample_nothing() -> None:
    d = DeviceDrafter(max_k=K, min_n=1, max_n=3, max_model_len=64, device="cpu")
    eagle = torch.full((2, K), 9)
    nothing = torch.zeros((2, 0), dtype=torch.int64)
    out = d.step(["a", "b"], nothing, eagle, {"a", "b"}, {"a": [7], "b": []}.get)
    assert out is not None and out.tolist() == eagle.tolist()  # too short to match: EAGLE's rows stay
    out = d.step(["a", "b"], torch.tensor([[7], [3]]), eagle, {"a", "b"}, {}.get)
    assert out is not None and out.tolist() == [[7] * K, [9] * K]  # a: 7 7: "7" at 0, then 7


def test_a_drafter_that_fails_is_switched_off_and_eagles_drafts_pass_through(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The runner's wrapper: an exception in the drafter (a device allocation that fails, say) is
    logged once, the drafter is dropped for the runner's lifetime, and every step returns EAGLE's
    drafts as vLLM made them."""
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner", reason="vLLM is not installed")
    from types import SimpleNamespace as NS

    from controller.vllm import worker

    eagle = torch.full((1, K), 5)
    monkeypatch.setattr(
        gmr.GPUModelRunner, "propose_draft_token_ids", lambda self, so, sampled, *a, **kw: eagle
    )
    monkeypatch.setattr(gmr.GPUModelRunner, "_speccontrol_patched", False, raising=False)
    monkeypatch.setattr(
        gmr.GPUModelRunner, "_bookkeeping_sync", gmr.GPUModelRunner._bookkeeping_sync
    )  # wrapped too
    worker.install_v1_runner(max_k=K, min_n=1, max_n=3, where="device")
    calls = []

    def boom(*a: Any) -> Any:
        calls.append(1)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(worker, "_merge_step", boom)
    runner = _runner("cpu", ["a"], {"a": [1, 2, 1]})
    so = NS(finished_req_ids=(), scheduled_cached_reqs=None)
    propose = gmr.GPUModelRunner.propose_draft_token_ids
    for _ in range(3):
        assert propose(runner, so, torch.tensor([[2]])) is eagle
    assert calls == [1] and runner._speccontrol_merger is None
    assert sum("merge failed; disabled" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("history", "want"),
    [
        # "3" first follows at 0 (draft 7 ...), "1 2 3" at 2 (draft 9 ...): the longest suffix wins
        ([3, 7, 1, 2, 3, 9, 4, 4, 1, 2, 3], [9, 4, 4, 1]),
        # "5 6" occurs at 0 and at 3: the earliest occurrence's continuation (8), not the latest (9)
        ([5, 6, 8, 5, 6, 9, 5, 6], [8, 5, 6, 9]),
        # only the suffix itself: no draft, EAGLE's row stays
        ([1, 2, 3, 4], [-7] * K),
    ],
)
def test_the_longest_suffix_wins_then_its_earliest_occurrence(history: list[int], want: list[int]) -> None:
    both = _Both(min_n=1, max_n=3)
    sampled = np.array([[history[-1]]], dtype=np.int64)
    both.step(["a"], sampled, np.full((1, K), -7, dtype=np.int64), {"a"}, {"a": history[:-1]}.get)
    got = both.dev.step(["a"], torch.zeros((1, 0), dtype=torch.int64), torch.full((1, K), -7), {"a"}, {}.get)
    assert got is not None and got.tolist() == [want]


def _wrapped_runner(monkeypatch: pytest.MonkeyPatch, eagle: Any, group: PeerGroup) -> tuple[Any, Any]:
    """The V1 runner's wrapped ``propose_draft_token_ids`` (over a stub that returns ``eagle``) and a
    runner in a tensor-parallel group."""
    gmr = pytest.importorskip("vllm.v1.worker.gpu_model_runner", reason="vLLM is not installed")
    from controller.vllm import worker

    monkeypatch.setattr(
        gmr.GPUModelRunner, "propose_draft_token_ids", lambda self, so, sampled, *a, **kw: eagle
    )
    monkeypatch.setattr(gmr.GPUModelRunner, "_speccontrol_patched", False, raising=False)
    monkeypatch.setattr(
        gmr.GPUModelRunner, "_bookkeeping_sync", gmr.GPUModelRunner._bookkeeping_sync
    )  # wrapped too
    worker.install_v1_runner(max_k=K, min_n=1, max_n=3, where="device")
    runner = _runner("cpu", ["a"], {"a": [5, 6, 7, 5, 6]})
    runner._speccontrol_tp = group
    return gmr.GPUModelRunner.propose_draft_token_ids, runner


@pytest.mark.parametrize("peer_failed", [False, True])
@pytest.mark.parametrize("as_list", [False, True])
def test_tensor_parallel_ranks_hand_on_eagles_drafts_once_any_rank_failed(
    monkeypatch: pytest.MonkeyPatch, peer_failed: bool, as_list: bool
) -> None:
    """Ranks that verified different drafts would corrupt a sharded forward: on a step with n-gram rows
    each rank adds its failures to the group's, and hands on EAGLE's drafts if any rank failed, else its
    merged ones (drafts as a tensor: decided on the device; as host rows: read once)."""
    from types import SimpleNamespace as NS

    from controller.vllm.mode import NGRAM_ROWS_ATTR

    eagle_rows = [[100] * K]
    eagle = eagle_rows if as_list else torch.tensor(eagle_rows)
    group = PeerGroup(peer_failed)
    propose, runner = _wrapped_runner(monkeypatch, eagle, group)
    so = NS(finished_req_ids=(), scheduled_cached_reqs=None, **{NGRAM_ROWS_ATTR: {"a"}})
    out = propose(runner, so, torch.tensor([[7]]))
    got = out if as_list else out.tolist()
    assert got == (eagle_rows if peer_failed else [[5, 6, 7, 7]])
    assert group.flags == [0.0]
    # A step without n-gram rows (the same steps on every rank) needs no agreement.
    plain = NS(finished_req_ids=(), scheduled_cached_reqs=None, **{NGRAM_ROWS_ATTR: frozenset()})
    assert propose(runner, plain, torch.tensor([[5]])) is eagle
    assert group.flags == [0.0]


def test_a_rank_whose_merge_failed_reports_it_on_every_later_ngram_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from types import SimpleNamespace as NS

    from controller.vllm import worker
    from controller.vllm.mode import NGRAM_ROWS_ATTR

    eagle = torch.full((1, K), 100)
    group = PeerGroup(peer_failed=False)
    propose, runner = _wrapped_runner(monkeypatch, eagle, group)

    def boom(*a: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(worker, "_merge_step", boom)
    so = NS(finished_req_ids=(), scheduled_cached_reqs=None, **{NGRAM_ROWS_ATTR: {"a"}})
    for _ in range(3):
        assert propose(runner, so, torch.tensor([[7]])).tolist() == eagle.tolist()
    assert group.flags == [1.0, 1.0, 1.0]  # its peers keep handing on EAGLE's drafts too
    assert runner._speccontrol_merger is None
    said = [r.getMessage() for r in caplog.records if "merge failed" in r.getMessage()]
    assert len(said) == 1 and "on every tensor-parallel rank" in said[0], said
