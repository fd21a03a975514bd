"""The hooks' per-request bookkeeping when a client reuses a request id, and when a request comes back
under its own id (a streaming-input session's next chunk; a resumed request under the V2 runner).

vLLM reports a request finished (``SchedulerOutput.finished_req_ids``) in the first schedule after it
finished or was aborted, and that same schedule may already run a new request under the same id: a
client that passes its own request ids (``LLM.generate`` with explicit ids, an API request id with id
randomisation off) and retries or reuses one after an abort. vLLM then holds a fresh ``Request``: its
prompt, its class, no draft. A request scheduled as new (``scheduled_new_reqs``) whose id the hooks still
hold comes back with a history of vLLM's making (a streaming session drops its last sampled token and
appends the next input chunk; the V2 runner lists a resumed request as new).

What must hold: from the step that schedules it, such a request has its own class, its own n-gram
history (exactly its tokens) and no plan of the old one's, under synchronous and async scheduling.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from controller.vllm.engine_hooks import EngineHooks
from policies.arms import METHOD_CODES, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import PlanEntry
from tests.controller.vllm.test_engine_hooks import (
    FakeAsyncScheduler,
    Req,
    _directive,
    _hooks,
    _rows,
    one_request_update,
)

pytestmark = pytest.mark.usefixtures("kernels")

#: "code" drafts n-gram at K 3, "chat" not at all: a plan (or placeholders) of the wrong class shows.
PLAN = (
    PlanEntry("code", 1, 0, Arm(Method.NGRAM, 3)),
    PlanEntry("chat", 1, 0, Arm(Method.OFF, 0)),
    PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 2)),
)
OLD = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # repeats: the old request's n-gram drafts are long
NEW = [50, 51, 52]


def _req(rid: str, cls: str, tokens: list[int]) -> Req:
    r = Req(rid, cls)
    r._all_token_ids = list(tokens)
    return r


def _output(sched: Any, *, new: tuple[str, ...] = (), finished: tuple[str, ...] = ()) -> Any:
    so = sched.output()
    so.scheduled_new_reqs = [types.SimpleNamespace(req_id=rid) for rid in new]
    so.finished_req_ids = set(finished)
    so.scheduled_cached_reqs = types.SimpleNamespace(resumed_req_ids=set())
    return so


def _update(h: EngineHooks, sched: Any, so: Any, sampled: dict[str, list[int]]) -> None:
    """vLLM's update_from_output: each scheduled request takes what it sampled."""
    reqs = h.before_update(sched, so)
    ids = list(so.num_scheduled_tokens)
    for rid in ids:
        sched.requests[rid]._all_token_ids += sampled[rid]
    mro = types.SimpleNamespace(sampled_token_ids=[sampled[r] for r in ids],
                                req_id_to_index={r: i for i, r in enumerate(ids)})  # fmt: skip
    h.after_update(sched, so, mro, reqs)


def _history(h: EngineHooks, rid: str) -> list[int]:
    assert h.scorer is not None
    return list(h.scorer.tokens(h.controls.fast.slot_of(rid, -1)).tolist())


def test_sync_an_id_reused_in_the_output_that_reports_it_finished_starts_afresh() -> None:
    """Synchronous scheduling: request "x" (class code, n-gram) is aborted between steps and a new
    "x" (class chat) is scheduled in the output that reports the old one finished. Its step reports
    class chat with no n-gram plan, and its history is its own prompt and tokens."""
    h, link = _hooks(_directive(1, *PLAN))
    h.async_composite = False
    s = FakeAsyncScheduler([_req("x", "code", OLD), _req("y", "chat", [9, 9])])
    for t in range(3):  # the old x runs and drafts n-gram (its plan is pending after the last step)
        so = _output(s)
        h.before_schedule(s)
        h.after_schedule(s, so)
        _update(h, s, so, {"x": [1 + t], "y": [8]})
        h.choose_drafts(["x", "y"], [[5, 5, 5], [5, 5, 5]])
    old_slot = h.controls.fast.slot_of("x", -1)
    del s.requests["x"]  # aborted between steps; the client sends a new request under the same id
    s.requests = {"x": _req("x", "chat", NEW), "y": s.requests["y"]}
    so = _output(s, new=("x",), finished=("x",))
    h.before_schedule(s)
    h.after_schedule(s, so)
    _update(h, s, so, {"x": [60], "y": [8]})
    rec = link.records[-1]
    j = list(rec.request_id).index("x")
    assert rec.class_names[int(rec.class_index[j])] == "chat"
    assert int(rec.method[j]) == METHOD_CODES[Method.OFF]  # drafted nothing, and none was planned
    assert _history(h, "x") == [*NEW, 60]
    assert _history(h, "y") == [9, 9, 8, 8, 8, 8]
    h.choose_drafts(["x", "y"], [[5, 5, 5], [5, 5, 5]])
    so = _output(s)
    h.before_schedule(s)
    h.after_schedule(s, so)
    _update(h, s, so, {"x": [61], "y": [8]})
    assert _history(h, "x") == [*NEW, 60, 61]
    assert h.controls.fast.slot_of("x", -1) >= 0 and old_slot >= 0
    assert len(h.scorer or ()) == 2  # x and y: the old x's history was given back


def test_async_an_id_reused_in_the_output_that_reports_it_finished_starts_afresh() -> None:
    """Async scheduling (batch queue: schedule N+1, then the update of N): the new "x" gets the
    placeholders of its own class (chat: none), not the old one's n-gram K, in the very schedule that
    reports the old one finished; its reports and history are its own."""
    h, link = _hooks(_directive(1, *PLAN))
    s = FakeAsyncScheduler([_req("x", "code", OLD), _req("y", "chat", [9, 9])])
    s.token = lambda rid: 7  # type: ignore[method-assign]
    pending = [s.schedule(h)]
    for _ in range(3):
        pending.append(s.schedule(h))
        s.update(h, pending.pop(0))
    assert len(s.requests["x"].spec_token_ids) == 3  # the old x drafts n-gram at K 3
    s.update(h, pending.pop(0))  # the pipeline drains; then x is aborted and sent again
    del s.requests["x"]
    s.requests = {"x": _req("x", "chat", NEW), "y": s.requests["y"]}
    h.before_schedule(s)
    so = _output(s, new=("x",), finished=("x",))
    placeholders = [-1] * so.num_spec_tokens_to_schedule
    for r in s.requests.values():
        r.spec_token_ids = placeholders
    h.size_placeholders(s, so)
    h.after_schedule(s, so)
    assert len(s.requests["x"].spec_token_ids) == 0  # chat: off
    n = len(link.records)
    s.update(h, so)
    assert [(rid, m) for i, rid, m, _, _ in _rows(link) if i >= n] == [("x", "off"), ("y", "off")]
    rec = link.records[-1]
    assert rec.class_names[int(rec.class_index[0])] == "chat"
    assert _history(h, "x") == NEW  # (the fake's update leaves the request's tokens as they are)


def test_sync_a_streaming_sessions_next_chunk_restarts_its_history() -> None:
    """A streaming-input session (vLLM's resumable request) that stopped keeps its id: vLLM drops its
    last sampled token, appends the next input chunk and schedules it as a new request, not reported
    finished. Its n-gram history is the request's tokens again from that step, and its class is the
    one the chunk's sampling parameters name."""
    h, link = _hooks(_directive(1, *PLAN))
    h.async_composite = False
    s = FakeAsyncScheduler([_req("s", "code", OLD)])
    for t in range(3):
        so = _output(s)
        h.before_schedule(s)
        h.after_schedule(s, so)
        _update(h, s, so, {"s": [1 + t]})
        h.choose_drafts(["s"], [[5, 5, 5]])
    req = s.requests["s"]
    del req._all_token_ids[-1:]  # Scheduler._update_request_as_session: the last sampled token goes
    req._all_token_ids += [70, 71, 72, 70, 71]  # and the next chunk comes
    req.sampling_params = types.SimpleNamespace(extra_args={"traffic_class": "chat"})
    so = _output(s, new=("s",))
    h.before_schedule(s)
    h.after_schedule(s, so)
    _update(h, s, so, {"s": [72]})
    assert _history(h, "s") == req._all_token_ids
    rec = link.records[-1]
    assert rec.class_names[int(rec.class_index[0])] == "chat"
    assert int(rec.method[0]) == METHOD_CODES[Method.OFF]  # the old chunk's n-gram plan was not verified
    h.choose_drafts(["s"], [[5, 5, 5]])
    so = _output(s)
    h.before_schedule(s)
    h.after_schedule(s, so)
    _update(h, s, so, {"s": [73]})
    assert _history(h, "s") == req._all_token_ids


def test_async_v2_a_resumed_request_listed_as_new_restarts_its_history() -> None:
    """The V2 model runner's schedules list a resumed request among the new ones (vLLM empties
    ``resumed_req_ids`` then): after a drop-mode preemption its history is its own tokens again."""
    h, _ = _hooks(_directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 2))))
    s = FakeAsyncScheduler([_req("r", "chat", [1, 2, 3])])
    req = s.requests["r"]

    update = one_request_update(h, s, req)
    update(s.schedule(h), [40], True)
    update(s.schedule(h), [41, 42], False)  # preempted in drop mode: vLLM drops this output
    so = s.schedule(h)
    so.scheduled_new_reqs = [types.SimpleNamespace(req_id="r")]  # resumed now, listed as new (V2)
    so.scheduled_cached_reqs = types.SimpleNamespace(resumed_req_ids=set())
    update(so, [51], True)
    update(s.schedule(h), [52], True)
    assert _history(h, "r") == req._all_token_ids == [1, 2, 3, 40, 51, 52]


class _Req(Req):
    def __init__(self, rid: str, cls: str) -> None:
        super().__init__(rid, cls)
        self.finished = False

    def is_finished(self) -> bool:
        return self.finished


def test_async_a_request_finished_while_its_next_step_ran_is_not_taken_back() -> None:
    """Async scheduling with a KV connector that delays freeing (P/D disaggregation, KV offloading):
    "x" finishes in the update of step N-1, after step N scheduled it; vLLM keeps the finished
    request in ``scheduler.requests`` until its KV is sent and skips its row in the update of step N
    (``request.is_finished()``). The hooks skip it too: it is not reported again, nor admitted again
    after the schedule that reported it finished released it (where nothing would release it)."""
    h, link = _hooks(_directive(1, PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 2))))
    x, y = _Req("x", "chat"), _Req("y", "chat")
    s = FakeAsyncScheduler([x, y])
    s.connector = object()  # type: ignore[attr-defined]  # vLLM's KV connector: frees may be delayed
    s.finished_req_ids = set()  # type: ignore[attr-defined]

    def schedule() -> Any:
        so = _output(s, finished=tuple(s.finished_req_ids))  # type: ignore[attr-defined]
        s.finished_req_ids = set()  # type: ignore[attr-defined]
        live = {r for r, q in s.requests.items() if not q.is_finished()}
        so.num_scheduled_tokens = {r: n for r, n in so.num_scheduled_tokens.items() if r in live}
        h.before_schedule(s)
        for r in live:
            s.requests[r].spec_token_ids = [-1] * so.num_spec_tokens_to_schedule
        h.size_placeholders(s, so)
        h.after_schedule(s, so)
        return so

    def update(so: Any, finishing: str = "") -> None:
        reqs = h.before_update(s, so)
        ids = list(so.num_scheduled_tokens)
        if finishing:  # vLLM's update: the request stops; the connector delays freeing it
            s.requests[finishing].finished = True
            s.finished_req_ids.add(finishing)  # type: ignore[attr-defined]
        mro = types.SimpleNamespace(sampled_token_ids=[[7] for _ in ids],
                                    req_id_to_index={r: i for i, r in enumerate(ids)})  # fmt: skip
        h.after_update(s, so, mro, reqs)

    pending = [schedule()]
    pending.append(schedule())
    update(pending.pop(0))
    pending.append(schedule())  # step N schedules x
    update(pending.pop(0), finishing="x")  # the update of N-1: x stops
    pending.append(schedule())  # reports x finished
    n = len(link.records)
    update(pending.pop(0))  # the update of N: vLLM skips x's row
    assert [rid for i, rid, _, _, _ in _rows(link) if i >= n] == ["y"]
    assert h.controls.fast.slot_of("x", -1) == -1
    assert len(h.scorer or ()) == 1
    del s.requests["x"]  # the KV was sent: vLLM frees it
    pending.append(schedule())
    update(pending.pop(0))
    update(pending.pop(0))
    assert h.controls.fast.slot_of("x", -1) == -1 and len(h.scorer or ()) == 1


def test_async_a_new_requests_first_plan_is_verified_as_planned() -> None:
    """Async scheduling: vLLM lists every request in its first schedule among ``scheduled_new_reqs``,
    and that schedule already gives it placeholders (its first plan, made in ``size_placeholders``).
    Its update must not take that plan for a stale one: the step that verifies the first draft
    reports it as planned (n-gram at K 3 for class code), not as "none recorded"."""
    h, link = _hooks(_directive(1, *PLAN))
    s = FakeAsyncScheduler([_req("x", "code", OLD)])
    first = s.schedule(h)
    first.scheduled_new_reqs = [types.SimpleNamespace(req_id="x")]
    assert len(s.requests["x"].spec_token_ids) == 3
    s.update(h, first)  # synchronous order (schedule, update) and the batch queue's alike below
    second = s.schedule(h)
    assert second.scheduled_spec_decode_tokens["x"] == [-1, -1, -1]
    n = len(link.records)
    s.update(h, second, accepted=2)
    assert [(rid, m, k, d) for i, rid, m, k, d in _rows(link) if i >= n] == [("x", "ngram", 3, 3)]
