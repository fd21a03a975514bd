"""The worker-side n-gram merge (async scheduling): histories from sampled rows, whole-row replacement
only for requests named on n-gram, checked against the n-gram rule on the full history."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.vllm.worker import DraftMerger
from policies.prompt_lookup import match_ngram
from tests.controller.vllm.strategies import BatchStep, batch_steps

pytestmark = pytest.mark.usefixtures("kernels")
K = 4


def _merger() -> DraftMerger:
    return DraftMerger(max_k=K, min_n=1, max_n=3, max_model_len=1 << 20)


def _rows(*rows: list[int]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(len(rows), -1)


def test_rows_on_ngram_replaced_others_kept_short_drafts_padded() -> None:
    m = _merger()
    prompts = {"a": [5, 6, 7, 5, 6], "b": [1, 2, 3], "c": [9, 8]}
    eagle = np.full((3, K), 100, dtype=np.int64)
    out = m.step(
        ["a", "b", "c"], _rows([7, -1, -1], [4, -1, -1], [9, -1, -1]), eagle, {"a", "b", "c"}, prompts.get
    )
    assert out is not None
    # a: 5 6 7 5 6 7: the suffix 5 6 7 first occurs at 0 and is followed by 5 6 7
    assert out[0].tolist() == [5, 6, 7, 7]  # three tokens, padded with the last
    assert out[1].tolist() == [100] * K  # 1 2 3 4: no match, EAGLE's row stays
    assert out[2].tolist() == [8, 9, 9, 9]  # 9 8 9: "9" first seen at 0, followed by 8 9
    assert eagle.tolist() == [[100] * K] * 3  # the input is not modified
    none = np.zeros((0, 1), dtype=np.int64)  # no row sampled this step
    assert m.step(["a", "b", "c"], none, eagle, {"b"}, prompts.get) is None  # nothing changes: no copy
    assert m.step(["a", "b", "c"], none, eagle, set(), prompts.get) is None
    # a row not stepped now drafts at its current position: the same draft again
    again = m.step(["a", "b", "c"], none, eagle, {"a"}, prompts.get)
    assert (
        again is not None and again[0].tolist() == [5, 6, 7, 7] and again[1:].tolist() == eagle[1:].tolist()
    )


def test_discarded_rows_finished_and_restarted_requests() -> None:
    m = _merger()
    prompts = {"a": [1, 2, 1, 2], "b": [3, 3, 3]}
    zero = np.zeros((1, K), dtype=np.int64)
    # a is a partial prefill this step: not started, its sampled token thrown away
    m.step(["a", "b"], _rows([77], [3]), None, (), prompts.get, discarded=np.array([True, False]))
    assert len(m) == 1
    m.step(["a", "b"], _rows([1], [3]), None, (), prompts.get, discarded=np.array([False, False]))
    assert len(m) == 2
    out = m.step(["a"], _rows([]), zero, {"a"}, prompts.get)
    assert out is not None and out[0].tolist() == [2, 1, 1, 1]  # 1 2 1 2 1: "1 2 1" first at 0
    m.step([], np.zeros((0, 1), dtype=np.int64), None, (), prompts.get, finished=["b"])
    assert len(m) == 1
    # a restarted request is rebuilt from what the runner knows
    out = m.step(["a"], _rows([9]), zero, {"a"}, lambda r: [9, 4], restarted=["a"])
    assert out is not None and out[0].tolist() == [4, 9, 9, 9]  # 9 4 9: "9" first at 0
    # prompt embeddings: no token ids, never on n-gram
    assert m.step(["e"], _rows([1]), zero, {"e"}, lambda r: None) is None


def test_the_runners_batch_list_changed_in_place() -> None:
    """vLLM's runner hands the same list every step, its rows replaced in place: a replaced row is
    the new request's (its own history), not the slot the list had before."""
    m = _merger()
    prompts = {"a": [1, 2, 1, 2], "b": [5, 6, 5, 6], "c": [7, 8, 7, 8]}
    ids = ["a", "b"]
    eagle = np.full((2, K), 100, dtype=np.int64)
    m.step(ids, _rows([1], [5]), eagle, {"a", "b"}, prompts.get)
    m.step(ids, _rows([2], [6]), eagle, {"a", "b"}, prompts.get)
    ids[1] = "c"  # b waits (not finished); c takes its row
    out = m.step(ids, _rows([1], [7]), eagle, {"a", "c"}, prompts.get)
    want = {
        "a": match_ngram(np.array([1, 2, 1, 2, 1, 2, 1], dtype=np.int32), 1, 3, 1 << 20, K).tolist(),
        "c": match_ngram(np.array([7, 8, 7, 8, 7], dtype=np.int32), 1, 3, 1 << 20, K).tolist(),
    }
    assert out is not None
    for i, r in enumerate(ids):
        assert out[i].tolist() == want[r] + [want[r][-1]] * (K - len(want[r]))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=30),
    st.lists(st.lists(st.integers(-1, 5), min_size=K + 1, max_size=K + 1), min_size=1, max_size=40),
    st.integers(1, 8),
    st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_merge_equals_the_rule_on_the_full_history(
    prompt: list[int], steps: list[list[int]], n: int, skip: list[bool]
) -> None:
    """n requests with the same stream but offset prompts: every step, every row equals vLLM's rule on
    the request's full history (prompt plus accepted tokens), or EAGLE's row where the rule drafts
    nothing; the rows on n-gram change from step to step, and some steps carry no tokens for anyone."""
    m = _merger()
    ids = [f"r{i}" for i in range(n)]
    hist = {r: [i, *prompt] for i, r in enumerate(ids)}
    base = {r: list(h) for r, h in hist.items()}
    started = False  # a request's history starts with the first step that samples for it
    for t, row in enumerate(steps):
        started = started or not skip[t]
        sampled = _rows(*[row] * n) if not skip[t] else np.zeros((0, K + 1), dtype=np.int64)
        eagle = np.full((n, K), -7, dtype=np.int64)
        on = set(ids[t % 2 :: 2])
        out = m.step(ids, sampled, eagle, on, base.get)
        if not skip[t]:
            for r in ids:
                hist[r] += [x for x in row if x >= 0]
        got = eagle if out is None else out
        for i, r in enumerate(ids):
            want = (
                match_ngram(np.array(hist[r], dtype=np.int32), 1, 3, 1 << 20, K).tolist()
                if r in on and started
                else []
            )
            if want:
                assert got[i].tolist() == want + [want[-1]] * (K - len(want))
            else:
                assert got[i].tolist() == [-7] * K


@settings(max_examples=80, deadline=None)
@given(batch_steps(K))
def test_a_deferred_step_gives_the_same_drafts(steps: list[BatchStep]) -> None:
    """``step_deferred`` (a step without n-gram rows applied at the next call) against ``step`` (applied
    now), driven alike: the same drafts at every step with n-gram rows, and the same histories after
    the last flush, with requests arriving, finishing, restarting and prefilling in between. The
    runner's list, mask and sampled buffer are reused and overwritten after each call, as vLLM's are."""
    now, later = _merger(), _merger()
    pool = [f"r{i}" for i in range(6)]
    clock = [0]  # what the runner knows of a request changes from step to step (its outputs grow)

    def known(r: str) -> list[int]:
        return [int(r[1:]) % 3, 1, int(r[1:]) % 2, 1, clock[0] % 3]

    ids: list[str] = []
    buf = np.zeros((6, K + 1), dtype=np.int64)
    mask = np.zeros(6, dtype=np.bool_)
    for rows, on_bits, skip_bits, fin_bits, re_bits, n, _ in steps:
        ids[:] = pool[:n]  # in place, as the runner's input batch
        finished = [r for i, r in enumerate(pool) if fin_bits >> i & 1 and r not in ids]
        restarted = [r for i, r in enumerate(ids) if re_bits >> i & 1]
        on = {r for i, r in enumerate(ids) if on_bits >> i & 1}
        buf[:n] = rows[:n]
        mask[:n] = [bool(skip_bits >> i & 1) for i in range(n)]
        eagle = np.full((n, K), -7, dtype=np.int64)
        want = now.step(ids, buf[:n], eagle, on, known, discarded=mask[:n], finished=finished,
                        restarted=restarted)  # fmt: skip
        got = later.step_deferred(ids, buf[:n], eagle, on, known, discarded=mask[:n],
                                  finished=finished, restarted=restarted)  # fmt: skip
        assert (want is None) == (got is None) or not on
        if on:
            assert (eagle if want is None else want).tolist() == (eagle if got is None else got).tolist()
        buf[:] = 99  # the runner's buffers are reused: a deferred step must have kept its own copy
        mask[:] = True
        clock[0] += 1
    later.flush()
    assert set(now._slot) == set(later._slot)
    for r, s in now._slot.items():
        assert now._index.tokens(s).tolist() == later._index.tokens(later._slot[r]).tolist()


def test_a_deferred_step_gives_the_same_drafts_at_serving_sizes() -> None:
    """As above at the sizes an engine serves: 128 rows, 1,000-token prompts (the index grows its
    arena and table while steps wait to be applied), 200 steps with runs of steps where no row is on
    n-gram, a request replaced in some row every step, vocabulary ids up to 2**31 - 1."""
    rng = np.random.default_rng(7)
    now, later = _merger(), _merger()
    rows, width = 128, K + 1
    phrase = rng.integers(0, 2**31 - 1, 40)
    prompts: dict[str, list[int]] = {}

    def known(r: str) -> list[int]:
        if r not in prompts:  # repetitive prompts, as real ones are: n-gram has matches to draft from
            mix = rng.random(1000) < 0.5
            prompts[r] = np.where(mix, rng.integers(0, 2**31 - 1, 1000), np.resize(phrase, 1000)).tolist()
        return prompts[r]

    ids = [f"r{i}" for i in range(rows)]
    fresh = rows
    finished: list[str] = []
    for t in range(200):
        sampled = np.where(rng.random((rows, width)) < 0.6, np.resize(phrase, (rows, width)), -1)
        sampled[:, 0] = phrase[t % 40]  # every row samples at least one token
        quiet = (t // 10) % 2 == 1  # ten steps with n-gram rows, then ten without
        on = set() if quiet else {r for r in ids if rng.random() < 0.5}
        eagle = np.full((rows, K), -7, dtype=np.int64)
        want = now.step(ids, sampled, eagle, on, known, finished=finished)
        got = later.step_deferred(ids, sampled, eagle, on, known, finished=finished)
        if on:
            assert (eagle if want is None else want).tolist() == (eagle if got is None else got).tolist()
        else:
            assert got is None
        gone = int(rng.integers(rows))  # one request leaves; a new one takes its row
        finished = [ids[gone]]
        ids[gone] = f"r{fresh}"
        fresh += 1
    later.flush()
    assert set(now._slot) == set(later._slot) and len(now) >= rows
    for r, s in now._slot.items():
        assert now._index.tokens(s).tolist() == later._index.tokens(later._slot[r]).tolist()


def _fake_runner_module(monkeypatch: pytest.MonkeyPatch, eagle: np.ndarray) -> type:
    """A ``vllm.v1.worker.gpu_model_runner`` whose ``GPUModelRunner`` samples as vLLM 0.32's does under
    async scheduling (``sample_tokens``, gpu_model_runner.py:4381-4483): the drafter runs first unless
    the batch does not fit it, then ``_bookkeeping_sync`` every step."""
    import sys
    import types

    class GPUModelRunner:
        max_model_len = 1 << 20
        device = "cpu"

        def __init__(self, prompts: dict[str, list[int]]) -> None:
            self.input_batch = types.SimpleNamespace(req_ids=list(prompts))
            self.requests = {
                r: types.SimpleNamespace(prompt_token_ids=p, output_token_ids=[-1])
                for r, p in prompts.items()
            }  # async scheduling: the runner's outputs are placeholders, never the tokens
            self.discard_request_mask = types.SimpleNamespace(np=np.zeros(8, dtype=bool))

        def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any, *a: Any) -> Any:
            return eagle.copy()

        def _bookkeeping_sync(self, scheduler_output: Any, sampler_output: Any, *a: Any) -> None:
            return None

        def sample_tokens(self, so: Any, sampled: np.ndarray, *, fits: bool) -> Any:
            drafts = self.propose_draft_token_ids(so, sampled) if fits else None
            self._bookkeeping_sync(so, types.SimpleNamespace(sampled_token_ids=sampled), None, None, 0)
            return drafts

    names = ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu_model_runner")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
    return GPUModelRunner


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_step_vllm_does_not_draft_still_reaches_the_histories(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """vLLM skips the drafter on a step where any request of the batch is within K tokens of
    max_model_len (``_input_fits_in_drafter``); every other request's tokens of that step must still
    enter its history, or its later n-gram drafts match a history with a gap (review finding 1)."""
    if where == "device":
        pytest.importorskip("torch", reason="torch is not installed (it runs in vLLM's environment)")
    from types import SimpleNamespace as NS

    from controller.vllm import worker
    from controller.vllm.mode import NGRAM_ROWS_ATTR

    eagle = np.full((2, 3), 999, dtype=np.int64)
    runner_cls = _fake_runner_module(monkeypatch, eagle)
    worker.install_v1_runner(max_k=3, min_n=1, max_n=3, where=where, kernels="torch")
    prompt_a = [5, 13, 7, 7, 10, 11, 12, 13, 14, 15]  # "13" twice, each with its own continuation
    runner = runner_cls({"a": prompt_a, "b": [1] * 8})  # b: the request near max_model_len

    def so(ngram: set[str]) -> Any:
        return NS(scheduled_cached_reqs=NS(resumed_req_ids=set()), finished_req_ids=set(),
                  **{NGRAM_ROWS_ATTR: frozenset(ngram)})  # fmt: skip

    truth = list(prompt_a)
    for sampled, fits in (([10, -1], True), ([11, 12], False), ([13, -1], True)):
        on = {"a"} if sampled[0] == 13 else set()
        out = runner.sample_tokens(so(on), np.array([sampled, [1, -1]], dtype=np.int64), fits=fits)
        truth += [t for t in sampled if t >= 0]
    want = match_ngram(np.array(truth, dtype=np.int32), 1, 3, 1 << 20, 3).tolist()
    assert want == [14, 15, 10]  # "13" last followed by 14 15 10, not the gapped history's 7 7 10
    assert np.asarray(out)[0].tolist() == want and np.asarray(out)[1].tolist() == [999] * 3
    if where == "host":
        merger = runner._speccontrol_merger
        merger.flush()
        assert merger._index.tokens(merger._slot["a"]).tolist() == truth


def test_without_the_bookkeeping_point_the_merge_still_installs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``_bookkeeping_sync`` is optional: a vLLM whose runner lacks it (or changed it) keeps the merge,
    with one line saying the histories miss the steps vLLM does not draft."""
    from controller.vllm import worker

    runner_cls = _fake_runner_module(monkeypatch, np.zeros((1, 3), dtype=np.int64))
    monkeypatch.delattr(runner_cls, "_bookkeeping_sync")
    worker.install_v1_runner(max_k=3, min_n=1, max_n=3, where="host")
    assert runner_cls._speccontrol_patched  # type: ignore[attr-defined]
    said = [r.getMessage() for r in caplog.records if "miss the steps" in r.getMessage()]
    assert len(said) == 1 and "_bookkeeping_sync" in said[0], said


def _fake_eagle_runner_module(
    monkeypatch: pytest.MonkeyPatch, kind: str, fail_below_width: bool = False
) -> type:
    """A ``vllm.v1.worker.gpu_model_runner`` whose ``propose_draft_token_ids`` reads the step's K as vLLM
    0.32's does (gpu_model_runner.py:4763, :5006-5007: once, at the start, handed to the proposer) and
    whose proposer (``vllm.v1.spec_decode.llm_base_proposer``) drafts rows x K of ``kind`` ("array",
    "tensor", "list"): row i's token t is ``900 + 10 * i + t``. The Ks it was asked for are in
    ``GPUModelRunner.asked``; ``fail_below_width``: a proposal at a K below the step's width raises."""
    import sys
    import types

    asked: list[int] = []

    class SpecDecodeBaseProposer:
        def propose(self, num_speculative_tokens: int, rows: int, width: int) -> Any:
            asked.append(num_speculative_tokens)
            if fail_below_width and num_speculative_tokens < width:
                raise RuntimeError("no CUDA graph for this K (test)")
            out = np.array([[900 + 10 * i + t for t in range(num_speculative_tokens)] for i in range(rows)])
            if kind == "tensor":
                import torch

                return torch.from_numpy(out).to(torch.int32)
            return out.tolist() if kind == "list" else out

    class GPUModelRunner:
        max_model_len = 1 << 20
        device = "cpu"

        def __init__(self, prompts: dict[str, list[int]], width: int) -> None:
            self.input_batch = types.SimpleNamespace(req_ids=list(prompts))
            self.requests = {
                r: types.SimpleNamespace(prompt_token_ids=p, output_token_ids=[-1])
                for r, p in prompts.items()
            }
            self.discard_request_mask = types.SimpleNamespace(np=np.zeros(8, dtype=bool))
            self.drafter = SpecDecodeBaseProposer()
            self.width = width
            self.prev_num_spec_tokens = 0

        def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any, *a: Any) -> Any:
            num_spec_tokens_to_schedule = scheduler_output.num_spec_tokens_to_schedule
            return self.drafter.propose(
                num_speculative_tokens=num_spec_tokens_to_schedule,
                rows=len(self.input_batch.req_ids),
                width=self.width,
            )

        def _copy_draft_token_ids_to_cpu(self, scheduler_output: Any) -> None:
            self.prev_num_spec_tokens = self._draft_token_ids.shape[1]

        def sample_tokens(self, so: Any, sampled: np.ndarray) -> Any:
            self._draft_token_ids = self.propose_draft_token_ids(so, sampled)
            if not isinstance(self._draft_token_ids, list):
                self._copy_draft_token_ids_to_cpu(so)
            return self._draft_token_ids

    GPUModelRunner.asked = asked  # type: ignore[attr-defined]
    names = ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu_model_runner", "vllm.v1.spec_decode",
             "vllm.v1.spec_decode.llm_base_proposer")  # fmt: skip
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[3]].GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
    sys.modules[names[5]].SpecDecodeBaseProposer = SpecDecodeBaseProposer  # type: ignore[attr-defined]
    return GPUModelRunner


def _step_output(width: int, eagle_k: int | None, ngram: set[str]) -> Any:
    from types import SimpleNamespace as NS

    from controller.vllm.mode import EAGLE_K_ATTR, NGRAM_ROWS_ATTR

    extra = {} if eagle_k is None else {EAGLE_K_ATTR: eagle_k}
    return NS(scheduled_cached_reqs=NS(resumed_req_ids=set()), finished_req_ids=set(),
              num_spec_tokens_to_schedule=width, **{NGRAM_ROWS_ATTR: frozenset(ngram)}, **extra)  # fmt: skip


@pytest.mark.parametrize("kind", ["array", "tensor", "list"])
def test_eagle_runs_at_its_own_k_and_ngram_rows_fill_the_width(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Width 8 (the K table's), EAGLE's rows planned at 3: vLLM's proposer runs 3 forwards, not 8; the
    drafts come back 8 wide, of the runner's own type (the next step reads them at ``row * 8``), the
    n-gram row's a whole n-gram draft of 8, the EAGLE row's 3 tokens then its last repeated (never
    verified: its placeholders are 3)."""
    if kind == "tensor":
        pytest.importorskip("torch", reason="torch is not installed (it runs in vLLM's environment)")
    from controller.vllm import worker

    runner_cls = _fake_eagle_runner_module(monkeypatch, kind)
    worker.install_v1_runner(max_k=8, min_n=1, max_n=3, where="host")
    prompt_a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]  # then 3: "1 2 3" is followed by 4 .. 10 1
    runner = runner_cls({"a": prompt_a, "b": [1] * 8}, 8)
    so = _step_output(8, 3, {"a"})
    out = runner.sample_tokens(so, np.array([[3, -1], [1, -1]], dtype=np.int64))
    assert runner_cls.asked == [3]
    assert so.num_spec_tokens_to_schedule == 8
    want = match_ngram(np.array([*prompt_a, 3], dtype=np.int32), 1, 3, 1 << 20, 8).tolist()
    assert want == [4, 5, 6, 7, 8, 9, 10, 1]
    assert type(out).__name__ == {"array": "ndarray", "tensor": "Tensor", "list": "list"}[kind]
    rows = out if kind == "list" else out.tolist()
    assert rows == [want, [910, 911, 912, 912, 912, 912, 912, 912]]
    if kind == "tensor":
        assert str(out.dtype) == "torch.int32"
    if kind != "list":
        assert runner.prev_num_spec_tokens == 8
    # A step whose EAGLE rows need the width, or without the attribute: vLLM as it is.
    runner.sample_tokens(_step_output(8, 8, {"a"}), np.array([[4, -1], [1, -1]], dtype=np.int64))
    runner.sample_tokens(_step_output(8, None, set()), np.array([[5, -1], [1, -1]], dtype=np.int64))
    assert runner_cls.asked == [3, 8, 8]


def test_eagle_k_failure_falls_back_to_the_full_width(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A proposal at the step's own K that raises: vLLM runs again at the full width (today's drafts),
    the step's K is restored, one line is logged, and later steps draft at the full width."""
    from controller.vllm import worker

    runner_cls = _fake_eagle_runner_module(monkeypatch, "array", fail_below_width=True)
    worker.install_v1_runner(max_k=8, min_n=1, max_n=3, where="host")
    runner = runner_cls({"a": [1, 2, 3], "b": [4, 5, 6]}, 8)
    outs = []
    for t in (7, 8):
        so = _step_output(8, 2, set())
        outs.append(runner.sample_tokens(so, np.array([[t, -1], [t, -1]], dtype=np.int64)))
        assert so.num_spec_tokens_to_schedule == 8
    assert runner_cls.asked == [2, 8, 8]
    assert [o.tolist() for o in outs] == [[[900 + t for t in range(8)], [910 + t for t in range(8)]]] * 2
    said = [r.getMessage() for r in caplog.records if "EAGLE at the step's own K" in r.getMessage()]
    assert len(said) == 1 and "(2 of 8)" in said[0], said


def test_a_vllm_that_reads_the_k_elsewhere_keeps_the_full_width(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the runner no longer reads the step's K as the plugin relies on (``compat.V1_EAGLE_K_POINTS``),
    EAGLE drafts at the full width, with one line saying why; the merge still installs."""
    from controller.vllm import worker

    runner_cls = _fake_eagle_runner_module(monkeypatch, "array")
    monkeypatch.delattr(runner_cls, "_copy_draft_token_ids_to_cpu")
    worker.install_v1_runner(max_k=8, min_n=1, max_n=3, where="host")
    runner = runner_cls({"a": [1, 2, 3]}, 8)
    runner._copy_draft_token_ids_to_cpu = lambda so: None
    out = runner.sample_tokens(_step_output(8, 2, set()), np.array([[7, -1]], dtype=np.int64))
    assert runner_cls.asked == [8] and out.shape == (1, 8)
    said = [r.getMessage() for r in caplog.records if "full placeholder width" in r.getMessage()]
    assert len(said) == 1 and "_copy_draft_token_ids_to_cpu" in said[0], said
