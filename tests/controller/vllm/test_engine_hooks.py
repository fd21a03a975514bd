"""The engine-core hooks under async scheduling, driven by a fake AsyncScheduler in vLLM's batch-queue
order (schedule N+1 runs before the update of step N): each request's placeholders are sized to its own
K, n-gram requests are named for the worker, and every verified draft is reported with the method and
K it was planned with, not a later plan."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from controller.validation import validate_hello
from controller.vllm import compat
from controller.vllm.control import Controls, engine_info
from controller.vllm.engine_hooks import EngineHooks, fixed_table_reason, verifying_plans
from controller.vllm.mode import NGRAM_ROWS_ATTR, k_table_only_reason, plugin_mode
from controller.vllm.ngram import NgramIndex
from controller.vllm.record import StepRecord
from controller.vllm.settings import PluginSettings
from controller.vllm.v2 import V2_POINTS
from controller.wire.convert import hello_from_engine_info
from policies.arms import METHOD_CODES, METHODS_BY_CODE, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import Directive, KRange, PlanEntry

MAX_K = 4
SETTINGS = PluginSettings(sidecar="unix:///tmp/none.sock")


class FakeLink:
    def __init__(self, directive: Directive) -> None:
        self.d = directive
        self.records: list[StepRecord] = []

    def fresh_directive(self) -> Directive:
        return self.d

    def offer(self, rec: StepRecord) -> bool:
        self.records.append(rec)
        return True


class Req:
    def __init__(self, rid: str, cls: str) -> None:
        self.request_id = rid
        self._all_token_ids = [1, 2, 3, 1, 2, 3]
        self.spec_token_ids: list[int] = []
        self.sampling_params = types.SimpleNamespace(extra_args={"traffic_class": cls})
        self.arrival_time = 0.0

    def is_finished(self) -> bool:
        return False


class FakeAsyncScheduler:
    """Just what the hooks read: requests, waiting, and vLLM's placeholder step (K from the table)."""

    def __init__(self, reqs: Sequence[Req]) -> None:
        self.requests = {r.request_id: r for r in reqs}
        self.waiting: list[Any] = []
        self.dynamic_sd_lookup: list[int] = [MAX_K] * 9

    def token(self, rid: str) -> int:
        """What a request samples next: 7, so histories repeat (n-gram matches)."""
        return 7

    def output(self) -> Any:
        """The scheduler output of a step that schedules every request with the draft it holds."""
        ids = list(self.requests)
        return types.SimpleNamespace(
            num_scheduled_tokens={r: 1 + len(self.requests[r].spec_token_ids) for r in ids},
            scheduled_spec_decode_tokens={
                r: list(q.spec_token_ids) for r, q in self.requests.items() if q.spec_token_ids
            },
            scheduled_new_reqs=[],
            finished_req_ids=set(),
            total_num_scheduled_tokens=len(ids),
            num_spec_tokens_to_schedule=self.dynamic_sd_lookup[len(ids)],
        )

    def schedule(self, hooks: EngineHooks) -> Any:
        hooks.before_schedule(self)
        ids = list(self.requests)
        so = self.output()
        placeholders = [-1] * so.num_spec_tokens_to_schedule
        for r in ids:  # AsyncScheduler._update_after_schedule: one shared placeholder list
            self.requests[r].spec_token_ids = placeholders
        hooks.size_placeholders(self, so)
        hooks.after_schedule(self, so)
        return so

    def update(self, hooks: EngineHooks, so: Any, accepted: int = 1) -> None:
        reqs = hooks.before_update(self, so)
        ids = list(so.num_scheduled_tokens)
        mro = types.SimpleNamespace(
            sampled_token_ids=[[self.token(r) for _ in range(1 + min(accepted, len(so.scheduled_spec_decode_tokens.get(r, ()))))]
                               for r in ids],
            req_id_to_index={r: i for i, r in enumerate(ids)},
        )  # fmt: skip
        hooks.after_update(self, so, mro, reqs)


def one_request_update(
    h: EngineHooks, s: FakeAsyncScheduler, req: Req
) -> Callable[[Any, list[int], bool], None]:
    """vLLM's update_from_output for a scheduler of the one request ``req`` (id "r"): ``update(so,
    sampled tokens, whether vLLM keeps them)`` (a drop-mode preemption drops a step's output)."""

    def update(so: Any, toks: list[int], vllm_keeps: bool) -> None:
        reqs = h.before_update(s, so)
        if vllm_keeps:  # what vLLM's update_from_output does with the tokens
            req._all_token_ids += toks
        mro = types.SimpleNamespace(sampled_token_ids=[toks] if toks else [], req_id_to_index={"r": 0})
        h.after_update(s, so, mro, reqs)

    return update


def _hooks(directive: Directive) -> tuple[EngineHooks, FakeLink]:
    info = engine_info(
        engine_id="e", model="m", method=Method.EAGLE3, max_k=MAX_K, max_batch_size=8, composite=True
    )
    controls = Controls(
        engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, MAX_K), composite=True
    )
    link = FakeLink(directive)
    h = EngineHooks(
        settings=SETTINGS, controls=controls, link=link,  # type: ignore[arg-type]
        scorer=NgramIndex(max_k=MAX_K), method=Method.EAGLE3,
    )  # fmt: skip
    h.async_composite = True
    return h, link


def _directive(version: int, *plan: PlanEntry, k: int = MAX_K) -> Directive:
    return Directive(
        version=version, policy="p", reason="", ttl_s=0, issued_at_s=0, k_table=(KRange(1, 0, k),),
        method=Method.EAGLE3, plan=plan,
    )  # fmt: skip


def _rows(link: FakeLink) -> list[tuple[int, str, str, int, int]]:
    return [
        (i, rid, METHODS_BY_CODE[int(r.method[j])].value, int(r.k[j]), int(r.drafted[j]))
        for i, r in enumerate(link.records)
        for j, rid in enumerate(r.request_id)
    ]


def test_placeholders_sized_per_request_and_ngram_rows_named() -> None:
    d = _directive(
        1,
        PlanEntry("code", 1, 0, Arm(Method.NGRAM, 2)),
        PlanEntry("bulk", 1, 0, Arm(Method.OFF, 0)),
        PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 3)),
    )
    h, link = _hooks(d)
    s = FakeAsyncScheduler([Req("a", "code"), Req("b", "chat"), Req("c", "bulk")])
    so = s.schedule(h)
    s.update(h, so)  # the first update teaches the hooks each request's class
    pending = [s.schedule(h)]
    for _ in range(300):  # batch queue: schedule N+1, then update N
        pending.append(s.schedule(h))
        s.update(h, pending.pop(0))
    last = pending[-1]
    assert {r: len(q.spec_token_ids) for r, q in s.requests.items()} == {"a": 2, "b": 3, "c": 0}
    assert getattr(last, NGRAM_ROWS_ATTR) == frozenset({"a"})
    ngram, eagle = METHOD_CODES[Method.NGRAM], METHOD_CODES[Method.EAGLE3]
    # c drafts nothing; each plan carries the n-gram proposal it was made with (the history ends in a
    # run of 7s, so the proposer matches and proposes a whole K)
    assert verifying_plans(last) == {"a": (ngram, 2, MAX_K), "b": (eagle, 3, MAX_K)}
    rows = _rows(link)[6:]
    assert len(rows) > 800
    want = {"a": ("ngram", 2, 2), "b": ("eagle3", 3, 3), "c": ("off", 0, 0)}
    assert all((m, k, dr) == want[rid] for _, rid, m, k, dr in rows), rows[:9]


def test_reports_the_plan_each_draft_was_made_with_across_a_change() -> None:
    h, link = _hooks(_directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 4))))
    s = FakeAsyncScheduler([Req(f"r{i}", "chat") for i in range(8)])
    pending = [s.schedule(h)]
    plans: list[dict[str, tuple[int, int, int]]] = []
    for step in range(200):
        if step == 100:
            link.d = _directive(2, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.NGRAM, 1)))
        pending.append(s.schedule(h))
        plans.append(verifying_plans(pending[0]))
        s.update(h, pending.pop(0))
    # Each record carries exactly the plan its scheduler output carried (never the newer one).
    for rec, plan in zip(link.records, plans, strict=True):
        for j, rid in enumerate(rec.request_id):
            assert rec.ngram_proposal is not None
            got = (int(rec.method[j]), int(rec.k[j]), int(rec.ngram_proposal[j]))
            code, k, prop = plan.get(rid, got)
            assert got == (code, k, prop if prop >= 0 else got[2])
            assert int(rec.drafted[j]) == k
    seen = [(m, k) for _, _, m, k, _ in _rows(link)]
    first_ngram = seen.index(("ngram", 1))
    assert set(seen[8:first_ngram]) == {("eagle3", 4)} and set(seen[first_ngram:]) == {("ngram", 1)}


def test_table_k_caps_the_plan() -> None:
    h, _ = _hooks(_directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.NGRAM, 4)), k=2))
    s = FakeAsyncScheduler([Req("a", "chat")])
    s.dynamic_sd_lookup = [2] * 9  # what vLLM's table gives; the plan cannot exceed its placeholders
    s.schedule(h)
    assert len(s.requests["a"].spec_token_ids) == 2


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"composite": False}, "switched off (SPECCONTROL_COMPOSITE=0)"),
        ({"method": Method.NGRAM}, "the engine drafts with n-gram only"),
        ({"sample": "probabilistic"}, "probabilistic draft sampling"),
        ({"v2": True}, "the V2 model runner"),
        ({"v2": True, "v2_composite": True}, "the V2 model runner with synchronous scheduling"),
        (
            {"v2": True, "v2_composite": True, "async": True, "adaptive": True},
            "the V2 model runner with adaptive",
        ),
        ({"v2": True, "v2_composite": True, "async": True}, None),
        ({"async": True, "adaptive": True}, None),
        ({}, None),
        ({"async": True}, None),
    ],
)
def test_plugin_mode_says_why(change: dict[str, Any], reason: str | None) -> None:
    vc = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(
            draft_sample_method=change.get("sample", "greedy"),
            enable_adaptive_verification=change.get("adaptive", False),
        ),
        use_v2_model_runner=change.get("v2", False),
        scheduler_config=types.SimpleNamespace(async_scheduling=change.get("async", False)),
    )
    settings = PluginSettings(
        sidecar="unix:///tmp/x.sock",
        composite=change.get("composite", True),
        v2_composite=change.get("v2_composite", False),
    )
    got = k_table_only_reason(settings=settings, method=change.get("method", Method.EAGLE3), vllm_config=vc)
    if reason is None:
        assert got is None and plugin_mode(got) == "per-request composite"
    else:
        assert got is not None and got.startswith(reason)
        assert plugin_mode(got) == f"K table only: {got}"


def test_the_hello_carries_a_long_mode_as_the_sidecar_takes_it() -> None:
    """Where vLLM has moved on, the mode names every patch point that no longer matches: four missing
    V2 points and the P-EAGLE fix's made 837 characters (and an exception's text may hold a line
    break), and the sidecar refused the Hello (plugin_mode_too_long): the plugin never attached, in
    just the engine it should have attached to in K-table-only mode, saying why."""

    def gone(name: str) -> types.ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}\n(moved)")

    runner = compat.problems(V2_POINTS, version=None, importer=gone)
    depths = compat.problems(compat.P_EAGLE_POINTS, version=None, importer=gone)
    mode = plugin_mode(
        "async scheduling, and the V2 model runner does not match: " + "; ".join(runner),
        p_eagle_depths="; ".join(depths),
    )
    info = engine_info(engine_id="e", model="m", method=Method.P_EAGLE, max_k=MAX_K, max_batch_size=8,
                       composite=False)  # fmt: skip
    hello = hello_from_engine_info(info, engine_version="vllm 0.32.0", plugin_mode=mode)
    validate_hello(hello)
    assert hello.plugin_mode.startswith("K table only: async scheduling, and the V2 model runner")


@pytest.mark.parametrize(
    ("dp", "lookup", "says"),
    [
        (1, [4] * 9, None),
        (2, [4] * 9, "data parallel size 2: every rank must draft the same K per step"),
        (4, None, "data parallel size 4"),
        (1, None, "not started with speculative_config.num_speculative_tokens_per_batch_size"),
    ],
)
def test_k_table_swapped_only_where_vllm_prepared_it(
    dp: int, lookup: list[int] | None, says: str | None
) -> None:
    vc = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=dp))
    got = fixed_table_reason(vc, lookup)
    assert got is None if says is None else (got is not None and says in got)


def test_fixed_table_is_never_swapped() -> None:
    h, _ = _hooks(_directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 2)), k=2))
    h.swap_table = False
    s = FakeAsyncScheduler([Req("a", "chat")])
    vllm_table = s.dynamic_sd_lookup
    s.schedule(h)
    assert s.dynamic_sd_lookup is vllm_table
    assert len(s.requests["a"].spec_token_ids) == 2  # K still cut per request


@pytest.mark.parametrize(
    ("given", "dp", "rank", "want"),
    [
        ("", 1, 0, "tiny@{host}"),
        ("pod-7", 1, 0, "pod-7"),
        ("pod-7", 2, 1, "pod-7/dp1"),
        ("", 4, 3, "tiny@{host}/dp3"),
        ("pod-7", 2, None, "pod-7/dp0"),
    ],
)
def test_each_data_parallel_rank_attaches_under_its_own_id(
    given: str, dp: int, rank: int | None, want: str
) -> None:
    """Data-parallel ranks share a host and an environment but are separate engines (each its own
    scheduler and stream): one id for all would make their streams one engine's."""
    import socket

    from controller.vllm.engine_hooks import engine_id_of

    pc = types.SimpleNamespace(data_parallel_size=dp, data_parallel_rank=rank)
    settings = PluginSettings(sidecar="unix:///tmp/x.sock", engine_id=given)
    got = engine_id_of(settings, "tiny", types.SimpleNamespace(parallel_config=pc))
    assert got == want.format(host=socket.gethostname())


@pytest.mark.parametrize("dp", [1, 100_000])
def test_every_engine_id_fits_the_sidecars_hello(dp: int) -> None:
    """The longest id a user may set, and a default built from a model path of any length (vLLM takes
    paths up to the file system's limit), at any data-parallel rank, passes the sidecar's Hello check;
    two long paths that differ only at the start stay distinct."""
    import socket

    from controller.validation import validate_hello
    from controller.vllm.engine_hooks import engine_id_of
    from controller.vllm.settings import MAX_ENGINE_ID_SETTING
    from controller.wire.convert import hello_from_engine_info

    pc = types.SimpleNamespace(data_parallel_size=dp, data_parallel_rank=dp - 1)
    vc = types.SimpleNamespace(parallel_config=pc)
    tail = "/snapshots/0123456789abcdef0123456789abcdef01234567" * 6
    ids = [
        engine_id_of(
            PluginSettings(sidecar="unix:///tmp/x.sock", engine_id="e" * MAX_ENGINE_ID_SETTING), "m", vc
        ),
        engine_id_of(PluginSettings(sidecar="unix:///tmp/x.sock"), "/mnt/a" + tail, vc),
        engine_id_of(PluginSettings(sidecar="unix:///tmp/x.sock"), "/mnt/b" + tail, vc),
        engine_id_of(PluginSettings(sidecar="unix:///tmp/x.sock"), "x" * 4096, vc),
    ]
    assert len(set(ids)) == len(ids)
    rank = "" if dp == 1 else f"/dp{dp - 1}"
    assert ids[1].endswith(f"{tail[-40:]}@{socket.gethostname()}{rank}")  # the path's distinguishing end
    for eid in ids:
        info = engine_info(
            engine_id=eid, model="m", method=Method.EAGLE3, max_k=MAX_K, max_batch_size=8, composite=True
        )
        assert validate_hello(hello_from_engine_info(info)).engine_id == eid


@pytest.mark.parametrize("samples_on_resume", [True, False])
def test_a_resumed_requests_history_restarts_from_its_own_tokens(samples_on_resume: bool) -> None:
    """vLLM drops the in-flight output of a request preempted in drop mode (``drop_stale_output``: a
    prefix-cache reset, a KV hand-off; also a failed KV load) and resamples those positions once it
    resumes it. The index took the dropped tokens; from the step that resumes the request (sampling
    or, a recompute chunk, not) its history is the request's again (review finding 5)."""
    h, _ = _hooks(_directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 2))))
    s = FakeAsyncScheduler([Req("r", "chat")])
    req = s.requests["r"]

    update = one_request_update(h, s, req)
    update(s.schedule(h), [40], True)
    update(s.schedule(h), [41, 42], False)  # preempted in drop mode: vLLM drops this output
    so = s.schedule(h)
    so.scheduled_cached_reqs = types.SimpleNamespace(resumed_req_ids={"r"})  # resumed now
    update(so, [51] if samples_on_resume else [], samples_on_resume)
    update(s.schedule(h), [52], True)
    slot = h.controls.fast.slot_of("r", -1)
    assert h.scorer is not None and h.scorer.tokens(slot).tolist() == req._all_token_ids
    assert req._all_token_ids == [1, 2, 3, 1, 2, 3, 40, *([51] if samples_on_resume else []), 52]


def test_a_new_requests_first_drafts_follow_its_own_class() -> None:
    """vLLM gives a request placeholders in the schedule its prefill completes, and with the batch
    queue plans its second draft before the first update of it: both must follow the request's own
    class's arm (here ``off``), not the default class's (review finding 3); and its n-gram history
    still starts at that first update."""
    d = _directive(
        1, PlanEntry("bulk", 1, 0, Arm(Method.OFF, 0)), PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 4))
    )
    h, link = _hooks(d)
    s = FakeAsyncScheduler([Req("c", "bulk")])
    pending = [s.schedule(h)]  # no update first: vLLM's order
    placeholders = [len(s.requests["c"].spec_token_ids)]
    for _ in range(4):  # batch queue: schedule N+1, then update N
        pending.append(s.schedule(h))
        placeholders.append(len(s.requests["c"].spec_token_ids))
        s.update(h, pending.pop(0))
    assert placeholders == [0] * 5
    assert [(rid, method, k) for _, rid, method, k, _ in _rows(link)] == [("c", "off", 0)] * 4
    slot = h.controls.fast.slot_of("c", -1)
    # started at the first update from the request's tokens (the fake's do not grow), then one a step
    assert h.scorer is not None and h.scorer.tokens(slot).tolist() == [1, 2, 3, 1, 2, 3, 7, 7, 7]


def _sync_step(h: EngineHooks, sched: Any, sampled: list[int], *, resumed: bool = False) -> list[list[int]]:
    """One synchronous step of request ``r``: the update (``sampled``: what it sampled, none for a
    prefill chunk; no draft verified), then post_step's ``update_draft_token_ids``, which lists r."""
    so = types.SimpleNamespace(num_scheduled_tokens={"r": 100}, scheduled_spec_decode_tokens={},
                               finished_req_ids=set(), total_num_scheduled_tokens=100,
                               num_spec_tokens_to_schedule=3, scheduled_new_reqs=[],
                               scheduled_cached_reqs=types.SimpleNamespace(resumed_req_ids={"r"} if resumed else set()))  # fmt: skip
    h.before_schedule(sched)
    reqs = h.before_update(sched, so)
    h.after_update(
        sched, so, types.SimpleNamespace(sampled_token_ids=[sampled], req_id_to_index={"r": 0}), reqs
    )
    return h.choose_drafts(["r"], [[9, 9, 9]])


def test_a_plan_whose_draft_vllm_drops_is_not_reported() -> None:
    """Synchronous scheduling lists every row of the batch in post_step, prefill chunks too, and vLLM
    drops their drafts (and a preemption clears a request's draft): a step that verified no draft is
    not reported as an n-gram step that drafted 0 and accepted 0, nor fed to the fast loop as one
    (review finding 4). An empty n-gram draft that was handed on still reports as n-gram."""
    h, link = _hooks(_directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.NGRAM, 3))))
    h.async_composite = False
    r = Req("r", "chat")
    r._all_token_ids = [1, 2, 3, 4]  # no n-gram match: its n-gram draft is empty
    sched = types.SimpleNamespace(requests={"r": r}, finished_req_ids=set(), waiting=[])
    assert _sync_step(h, sched, []) == [[]]  # chunk 1 samples nothing; vLLM drops what it gets
    _sync_step(h, sched, [7])  # chunk 2, the last: samples, verified no draft
    assert [(rid, method, k) for _, rid, method, k, _ in _rows(link)] == [("r", "off", 0)]
    slot = h.controls.fast.slot_of("r", -1)
    assert np.isnan(h.controls.fast._ewma[slot]).all()  # no n-gram step recorded
    _sync_step(h, sched, [8])  # its empty n-gram draft was handed on: an n-gram step
    assert _rows(link)[-1][1:4] == ("r", "ngram", 3)
    # preempted after that plan (vLLM clears its draft), resumed: nothing was verified
    _sync_step(h, sched, [5], resumed=True)
    assert _rows(link)[-1][1:4] == ("r", "off", 0)


def _hooks_at(
    max_k: int, directive: Directive, table_ks: set[int] | None = None, max_batch_size: int = 8
) -> EngineHooks:
    """Hooks of an EAGLE-3 engine of K max ``max_k`` whose start-up table prepared ``table_ks``."""
    info = engine_info(engine_id="e", model="m", method=Method.EAGLE3, max_k=max_k, max_batch_size=max_batch_size,
                       composite=True, table_ks=table_ks)  # fmt: skip
    controls = Controls(engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, max_k),
                        composite=True, table_ks=table_ks)  # fmt: skip
    h = EngineHooks(settings=SETTINGS, controls=controls, link=FakeLink(directive),  # type: ignore[arg-type]
                    scorer=NgramIndex(max_k=max_k), method=Method.EAGLE3)  # fmt: skip
    h.async_composite = True
    return h


@pytest.mark.parametrize(
    ("arms", "table_ks", "eagle_k"),
    [
        ({"code": "ngram:8", "chat": "eagle3:3"}, None, 3),  # n-gram rows fill the width, EAGLE's own K
        ({"code": "ngram:8", "chat": "eagle3:3"}, {2, 4, 8}, 4),  # raised to a K vLLM prepared
        ({"code": "ngram:8", "chat": "eagle3:2", "bulk": "eagle3:1"}, None, 2),  # the largest of EAGLE's
        ({"code": "ngram:8"}, None, 1),  # no EAGLE row: its first forward still runs
        ({"code": "ngram:8", "bulk": "off"}, {2, 4, 8}, 2),  # off rows need nothing: 1, prepared 2
        ({"code": "ngram:3", "chat": "eagle3:8"}, None, 8),  # EAGLE's rows need the width
    ],
)
def test_eagle_k_is_its_own_rows_largest_k(
    arms: dict[str, str], table_ks: set[int] | None, eagle_k: int
) -> None:
    """The worker runs EAGLE at ``EAGLE_K_ATTR``: n-gram rows may draft to the table's width (8) while
    EAGLE runs only as many forwards as its own rows' plans need."""
    from controller.vllm.mode import EAGLE_K_ATTR

    d = _directive(1, *(PlanEntry(c, 1, 0, Arm.parse(a)) for c, a in arms.items()), k=8)
    h = _hooks_at(8, d, table_ks)
    s = FakeAsyncScheduler([Req(c, c) for c in arms])
    s.dynamic_sd_lookup = [8] * 9
    pending = [s.schedule(h)]
    for _ in range(6):  # batch queue: schedule N+1, then update N
        pending.append(s.schedule(h))
        s.update(h, pending.pop(0))
    last = pending[-1]
    assert last.num_spec_tokens_to_schedule == 8
    want = {c: Arm.parse(a).k for c, a in arms.items()}
    assert {r: len(q.spec_token_ids) for r, q in s.requests.items()} == want
    assert getattr(last, NGRAM_ROWS_ATTR) == frozenset(c for c, a in arms.items() if a.startswith("ngram"))
    assert getattr(last, EAGLE_K_ATTR) == eagle_k


def test_eagle_k_never_exceeds_the_step_width() -> None:
    from controller.vllm.mode import EAGLE_K_ATTR

    h = _hooks_at(8, _directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 8)), k=2))
    s = FakeAsyncScheduler([Req("a", "chat")])
    so = s.schedule(h)
    assert so.num_spec_tokens_to_schedule == 2 and getattr(so, EAGLE_K_ATTR) == 2


@pytest.mark.parametrize(("table_ks", "eagle_k"), [(None, 5), ({2, 4, 8}, 8)])
def test_eagle_k_at_a_full_batch_of_256_mixed_rows(table_ks: set[int] | None, eagle_k: int) -> None:
    # A realistic batch: 256 requests of four classes (n-gram at the width, EAGLE-3 at 3 and 5, off).
    from controller.vllm.mode import EAGLE_K_ATTR

    arms = {"code": "ngram:8", "chat": "eagle3:3", "maths": "eagle3:5", "bulk": "off"}
    d = _directive(1, *(PlanEntry(c, 1, 0, Arm.parse(a)) for c, a in arms.items()), k=8)
    h = _hooks_at(8, d, table_ks, max_batch_size=256)
    classes = list(arms)
    s = FakeAsyncScheduler([Req(f"r{i}", classes[i % 4]) for i in range(256)])
    s.dynamic_sd_lookup = [8] * 257
    pending = [s.schedule(h)]
    for _ in range(4):
        pending.append(s.schedule(h))
        s.update(h, pending.pop(0))
    last = pending[-1]
    assert last.num_spec_tokens_to_schedule == 8
    assert {
        len(q.spec_token_ids)
        for q in s.requests.values()
        if q.sampling_params.extra_args["traffic_class"] == "chat"
    } == {3}
    assert len(getattr(last, NGRAM_ROWS_ATTR)) == 64
    assert getattr(last, EAGLE_K_ATTR) == eagle_k


class FakeSyncScheduler(FakeAsyncScheduler):
    """Synchronous scheduling: each step verifies the drafts the requests hold, vLLM's drafter then
    drafts ``num_spec_tokens_to_schedule`` tokens for every row (token 5), and post_step hands those
    to ``update_draft_token_ids``, whose choice the requests hold next."""

    def step(self, hooks: EngineHooks) -> Any:
        hooks.before_schedule(self)
        ids = list(self.requests)
        so = self.output()
        hooks.after_schedule(self, so)
        self.update(hooks, so)
        drafts = hooks.choose_drafts(ids, [[5] * so.num_spec_tokens_to_schedule for _ in ids])
        for r, d in zip(ids, drafts, strict=True):
            self.requests[r].spec_token_ids = d
        return so


def _sync_hooks(max_k: int, directive: Directive, table_ks: set[int] | None = None) -> EngineHooks:
    h = _hooks_at(max_k, directive, table_ks, max_batch_size=256)
    h.async_composite = False
    h.sync_drafter_k = True
    return h


@pytest.mark.parametrize(
    ("arms", "table_ks", "drafter_k"),
    [
        ({"code": "ngram:8", "chat": "eagle3:3"}, None, 3),  # EAGLE's own rows' K, n-gram's drafts whole
        ({"code": "ngram:8", "chat": "eagle3:3"}, {2, 4, 8}, 4),  # raised to a K vLLM prepared
        ({"code": "ngram:8", "chat": "eagle3:2", "bulk": "eagle3:1"}, None, 2),  # the largest of EAGLE's
        ({"code": "ngram:8"}, None, 1),  # no EAGLE row: its first forward still runs
        ({"code": "ngram:8", "bulk": "off"}, {2, 4, 8}, 2),  # off rows need nothing: 1, prepared 2
        ({"code": "ngram:3", "chat": "eagle3:8"}, None, 8),  # EAGLE's rows need the table's K
    ],
)
def test_sync_drafter_runs_at_its_own_rows_k(
    arms: dict[str, str], table_ks: set[int] | None, drafter_k: int
) -> None:
    """Synchronous scheduling: vLLM runs EAGLE at the step's ``num_spec_tokens_to_schedule``, which the
    plugin lowers from the table's entry (8) to the largest K its own rows plan; each row still gets
    its own K, n-gram rows their n-gram drafts (not cut by EAGLE's K)."""
    d = _directive(1, *(PlanEntry(c, 1, 0, Arm.parse(a)) for c, a in arms.items()), k=8)
    h = _sync_hooks(8, d, table_ks)
    s = FakeSyncScheduler([Req(c, c) for c in arms])
    for c in arms:  # a long copy: n-gram drafts as long as it may
        s.requests[c]._all_token_ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 3 + [1, 2, 3, 4]
    steps = [s.step(h) for _ in range(6)]
    assert s.dynamic_sd_lookup[len(arms)] == 8  # the table as the directive says
    assert {so.num_spec_tokens_to_schedule for so in steps[2:]} == {drafter_k}
    want = {c: Arm.parse(a).k for c, a in arms.items()}
    eagle = {c for c, a in arms.items() if a.startswith("eagle")}
    assert {r: len(q.spec_token_ids) for r, q in s.requests.items() if r in eagle} == {
        c: want[c] for c in eagle
    }
    recs = [row for row in _rows(h.link) if row[0] >= 2]  # type: ignore[arg-type]
    for _, rid, method, k, drafted in recs:
        assert (method, k) == ((arms[rid].split(":")[0], want[rid]) if want[rid] else ("off", 0)), recs
        assert drafted <= k


def test_sync_a_row_leaving_ngram_gets_what_eagle_drafted_and_reports_it() -> None:
    """The guess is made before the plans: a row whose pending plan is n-gram's is left out of it, so
    when its class turns to EAGLE-3 its first EAGLE draft is as long as EAGLE ran (1), reported so
    (K 1, not the plan's 3: the fast loop sees the K verified); from the next step on, 3."""
    h = _sync_hooks(8, _directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.NGRAM, 4)), k=8))
    s = FakeSyncScheduler([Req("a", "chat")])
    for _ in range(3):
        s.step(h)
    assert s.step(h).num_spec_tokens_to_schedule == 1
    h.link.d = _directive(2, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 3)), k=8)  # type: ignore[attr-defined]
    ks = [s.step(h).num_spec_tokens_to_schedule for _ in range(3)]
    assert ks == [1, 3, 3]
    rows = _rows(h.link)  # type: ignore[arg-type]
    assert [(m, k, dr) for _, _, m, k, dr in rows[-2:]] == [("eagle3", 1, 1), ("eagle3", 3, 3)], rows


def test_sync_drafter_k_at_a_full_batch_of_256_mixed_rows() -> None:
    arms = {"code": "ngram:8", "chat": "eagle3:3", "maths": "eagle3:5", "bulk": "off"}
    d = _directive(1, *(PlanEntry(c, 1, 0, Arm.parse(a)) for c, a in arms.items()), k=8)
    h = _sync_hooks(8, d, {2, 4, 8})
    classes = list(arms)
    s = FakeSyncScheduler([Req(f"r{i}", classes[i % 4]) for i in range(256)])
    s.dynamic_sd_lookup = [8] * 257
    steps = [s.step(h) for _ in range(4)]
    assert [so.num_spec_tokens_to_schedule for so in steps] == [8, 8, 8, 8]  # maths' 5, prepared as 8
    arms["maths"] = "ngram:8"  # maths turns to n-gram: EAGLE needs chat's 3 only
    h.link.d = _directive(2, *(PlanEntry(c, 1, 0, Arm.parse(a)) for c, a in arms.items()), k=8)  # type: ignore[attr-defined]
    steps = [s.step(h) for _ in range(3)]
    assert steps[-1].num_spec_tokens_to_schedule == 4  # chat's 3, prepared as 4
    lens = {
        len(q.spec_token_ids)
        for q in s.requests.values()
        if q.sampling_params.extra_args["traffic_class"] == "chat"
    }
    assert lens == {3}


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_the_drafter_keeps_the_tables_k_where_vllm_did_not_prepare_dynamic_k(scheduling: str) -> None:
    """Where the table may not be swapped (no start-up schedule: vLLM prepared only its max K; data
    parallelism: every rank must draft the same K), EAGLE runs at the step's K, as vLLM set it."""
    from controller.vllm.mode import EAGLE_K_ATTR

    d = _directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.NGRAM, 8)), k=8)
    h = _sync_hooks(8, d) if scheduling == "sync" else _hooks_at(8, d)
    h.swap_table = False
    if scheduling == "sync":
        s = FakeSyncScheduler([Req("a", "code")])
        s.dynamic_sd_lookup = [8] * 9
        assert {s.step(h).num_spec_tokens_to_schedule for _ in range(4)} == {8}
    else:
        s2 = FakeAsyncScheduler([Req("a", "code")])
        s2.dynamic_sd_lookup = [8] * 9
        assert {getattr(s2.schedule(h), EAGLE_K_ATTR) for _ in range(4)} == {8}


def test_sync_the_guess_made_with_the_plans_equals_the_one_made_at_the_schedule() -> None:
    """``update_draft_token_ids``' kernel makes the next schedule's guess with the plans it makes (one
    call less on the engine thread); over a batch of mixed classes drafting by the span rule, with a
    directive change and a request leaving, it is the guess the schedule would make itself, and it is
    not used where the batch or the directive differ."""
    from policies.rules import validate_rule

    arms = {"code": "eagle3:2", "chat": "eagle3:3", "maths": "eagle3:5", "bulk": "off"}

    def directive(version: int) -> Directive:
        d = _directive(version, *(PlanEntry(c, 1, 0, Arm.parse(a)) for c, a in arms.items()), k=8)
        return dataclasses.replace(d, rule=validate_rule("ngram_span", {}))

    h = _sync_hooks(8, directive(1), {2, 4, 8})
    classes = list(arms)
    s = FakeSyncScheduler([Req(f"r{i}", classes[i % 4]) for i in range(64)])
    fresh = iter(range(1000, 10**6))
    copying = {f"r{i}" for i in range(64) if i % 3 == 0}  # a third in a copy (n-gram rows), the rest
    s.token = lambda rid: 7 if rid in copying else next(fresh)  # type: ignore[method-assign]
    for rid, q in s.requests.items():  # sample tokens never seen (no n-gram match)
        q._all_token_ids = [1, 2, 3, 1, 2, 3] if rid in copying else [1, 2, 3, 4]
    s.dynamic_sd_lookup = [8] * 65
    seen = set()
    checked = 0
    for step in range(12):
        if step == 6:
            arms["maths"] = "ngram:8"
            h.link.d = directive(2)  # type: ignore[attr-defined]
        if step == 9:
            s.requests.pop("r0")
        ids = list(s.requests)
        h.before_schedule(s)
        cached = h.kernels.chosen_drafter_k(h.directive, len(ids))
        if cached >= 0:
            assert cached == h.kernels.drafter_k_guess(h.directive, ids, len(ids)), step
            checked += 1
            seen.add(cached)
        s.step(h)
    assert checked >= 8 and seen == {5, 3}, seen  # maths' 5, then (maths on n-gram) chat's 3
    assert h.kernels.chosen_drafter_k(h.directive, 7) == -1  # another batch size: other arms


def test_warm_up_compiles_every_step_kernel_before_serving() -> None:
    """numba compiles a kernel on its first call; one first called while serving would stall the
    engine thread for its compile. ``warm_up`` calls every hook kernel once."""
    from controller.vllm import hotpath
    from policies import jit

    if not jit.numba_available():
        pytest.skip("numba is not installed here (vLLM's environment has it: test_kernels_compiled)")
    jit.use_numba(True)
    try:
        h = _sync_hooks(8, _directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 3)), k=8))
        h.warm_up()
        kernels = {n: k for n, k in vars(hotpath).items() if isinstance(k, jit.Kernel)}
        assert {"_after_update", "_choose", "_place", "_drafter_k_guess"} <= set(kernels)
        assert [n for n, k in kernels.items() if k.compiled is None] == []
    finally:
        jit.use_numba(None)
