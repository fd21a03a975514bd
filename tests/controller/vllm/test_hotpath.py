"""The hooks' fused per-step kernels against the batch APIs they fuse, on a fake scheduler.

A scripted engine (requests arrive with prompts, sample 1-5 tokens a step or a prefill chunk that
samples nothing, finish or are aborted, classes differ) drives ``EngineHooks`` through hundreds of
steps; the same steps go through ``FastLoop`` / ``RequestTable`` / ``NgramIndex`` / ``Controls`` called
one after another, as the hooks did before the kernels were fused. Reports, drafts and per-request
state must match exactly, and every report must pass the sidecar's validation.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from controller.v1 import controller_pb2 as pb
from controller.validation import Limits, validate_batch
from controller.vllm.control import Controls, engine_info
from controller.vllm.engine_hooks import EngineHooks
from controller.vllm.ngram import NgramIndex
from controller.vllm.record import StepRecord
from controller.vllm.rows import RequestTable
from controller.vllm.settings import PluginSettings
from policies.arms import METHOD_CODES, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import Directive, KRange, PlanEntry
from policies.observation import NOT_SCORED
from policies.prompt_lookup import match_ngram
from policies.rules import validate_rule

pytestmark = pytest.mark.usefixtures("kernels")
MAX_K = 4


class Link:
    def __init__(self, directive: Directive) -> None:
        self.directive = directive
        self.records: list[StepRecord] = []

    def offer(self, rec: StepRecord) -> bool:
        self.records.append(rec)
        return True

    def fresh_directive(self) -> Directive:
        return self.directive

    def close(self) -> None:
        pass


@dataclass
class Req:
    request_id: str
    _all_token_ids: list[int]
    sampling_params: Any
    finished: bool = False
    arrival_time: float = 0.0

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class Reference:
    """The batch APIs called one after another (the hooks' work before the kernels were fused)."""

    controls: Controls
    rows: RequestTable
    index: NgramIndex | None
    drafts: list[list[int]] = field(default_factory=list)

    def after_update(
        self,
        ids: list[str],
        gens: list[list[int]],
        drafted: list[int],
        finished: list[bool],
        reqs: dict[str, Req],
    ) -> tuple[np.ndarray, ...]:
        fast = self.controls.fast
        slots = fast.slots(ids)
        fresh = self.rows.admit(slots)
        new = [list(g) for g in gens]
        for j in fresh:
            extra = reqs[ids[j]].sampling_params.extra_args or {}
            self.rows.set_class(int(slots[j]), str(extra.get("traffic_class") or "default"))
            if self.index is not None:
                self.index.start(int(slots[j]), reqs[ids[j]]._all_token_ids)
            new[j] = []
        fin = np.array(finished, dtype=bool)
        # The proposal before this step's tokens: the one a row without a recorded plan reports.
        proposal = (
            self.index.drafts(slots)[1].astype(np.int32)
            if self.index is not None
            else np.full(len(ids), -1, dtype=np.int32)
        )
        if self.index is not None:
            offsets = np.cumsum([0, *map(len, new)]).astype(np.int64)
            tokens = np.array(list(itertools.chain.from_iterable(new)), dtype=np.int32)
            cf = self.index.step(slots, tokens, offsets, ~fin)
        else:
            cf = np.full(len(ids), NOT_SCORED, dtype=np.int32)
        lens = np.array([len(g) for g in gens], dtype=np.int64)
        methods, ks, accepted = self.rows.columns(
            slots, lens, np.array(drafted, dtype=np.int64), cf, proposal
        )
        if ids:
            counterfactual = {Method.NGRAM: cf} if self.index is not None else {}
            fast.feedback(ids, methods, accepted, counterfactual, alpha=0.3, slots=slots)
        classes = self.rows.class_index(slots)
        for j in np.flatnonzero(fin):
            self.release(ids[j])
        return methods, ks, accepted, cf, classes, proposal

    def release(self, rid: str) -> None:
        s = self.controls.fast.release(rid)
        if s is not None:
            self.rows.release(s)
            if self.index is not None:
                self.index.release(s)

    def choose(
        self, d: Directive, ids: list[str], drafts: list[list[int]], idle: set[str] = frozenset()
    ) -> list[list[int]]:
        slots = self.controls.fast.slots(ids)
        self.rows.admit(slots, mark=False)
        prop = None
        if self.index is not None:
            # (a request first seen here, its first update a prefill chunk, may take a new slot)
            self.index.reserve(self.controls.fast.capacity)
            live = np.array([self.index.live(int(s)) for s in slots], dtype=bool)
            prop = np.where(live, self.index.drafts(slots)[1], -1)
        plan = self.controls.plan(
            d, ids, self.rows.classes(slots), len(ids), slots=slots, ngram_proposal=prop
        )
        if self.index is not None:
            rows, lens = self.index.drafts(slots)
            chosen = self.controls.choose_drafts(plan, drafts, rows.tolist(), lens)
        else:
            chosen = self.controls.choose_drafts(plan, drafts, drafts, np.zeros(len(ids), dtype=np.int64))
        self.rows.planned(slots, plan.method, plan.k, prop)
        dropped = [int(s) for s, r in zip(slots, ids, strict=True) if r in idle]  # vLLM drops their drafts
        self.rows.arrays()[0][dropped] = -1
        return chosen


def _directive(rule: str) -> Directive:
    return Directive(
        version=3,
        policy="p",
        reason="",
        ttl_s=0,
        issued_at_s=0,
        k_table=(KRange(1, 0, MAX_K),),
        method=Method.EAGLE3,
        plan=(
            PlanEntry("code", 1, 0, Arm(Method.NGRAM, 2)),
            PlanEntry("bulk", 1, 0, Arm(Method.OFF, 0)),
            PlanEntry(ANY_CLASS, 1, 16, Arm(Method.EAGLE3, 3)),
            PlanEntry(ANY_CLASS, 17, 0, Arm(Method.EAGLE3, 2)),
        ),
        rule=validate_rule(rule, {"warmup_steps": 1} if rule == "ngram_margin" else {}),
    )


@pytest.mark.parametrize("composite", [True, False])
@pytest.mark.parametrize("rule", ["ngram_span", "ngram_margin", "none"])
def test_hooks_report_and_draft_as_the_batch_apis(composite: bool, rule: str) -> None:
    rng = random.Random(f"{composite}{rule}")
    d = _directive(rule)
    info = engine_info(engine_id="e", model="m", method=Method.EAGLE3, max_k=MAX_K, max_batch_size=64,
                       composite=composite)  # fmt: skip

    def parts() -> tuple[Controls, RequestTable, NgramIndex | None]:
        c = Controls(engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, MAX_K),
                     composite=composite, capacity=2)  # fmt: skip
        ix = NgramIndex(max_k=MAX_K, max_model_len=400, capacity=2) if composite else None
        return c, RequestTable(configured=Method.EAGLE3, max_k=MAX_K, capacity=2), ix

    link = Link(d)
    c, _, ix = parts()
    hooks = EngineHooks(settings=PluginSettings(sidecar="unix:///unused"), controls=c, link=link,  # type: ignore[arg-type]
                        scorer=ix, method=Method.EAGLE3)  # fmt: skip
    ref = Reference(*parts())
    reqs: dict[str, Req] = {}
    drafts: dict[str, list[int]] = {}
    serial = itertools.count()
    proposals: list[int] = []
    vocab = 6  # small: n-gram matches often
    # vLLM's scheduler lists the requests it finished since its last schedule; half the runs read
    # finishes from it, the others from the requests themselves (a scheduler without the set).
    sched = SimpleNamespace(requests=reqs, waiting=[], dynamic_sd_lookup=None)
    if rule != "ngram_margin":
        sched.finished_req_ids = set()
    # Requests aborted between steps: out of the scheduler, reported finished by the next schedule
    # (and not scheduled by it: vLLM reports a request finished in the first schedule after it left).
    aborted: set[str] = set()
    for step in range(250):
        for _ in range(rng.choice([0, 0, 1, 3]) if len(reqs) < 40 else 0):
            rid = f"r{next(serial)}"
            cls = rng.choice([None, "code", "bulk", "chat"])
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
            reqs[rid] = Req(rid, prompt, SimpleNamespace(extra_args={"traffic_class": cls} if cls else None))
        ids = list(reqs)
        if not ids:
            continue  # an idle step reports nothing
        so = SimpleNamespace(
            scheduled_new_reqs=[], num_scheduled_tokens={r: 1 + len(drafts.get(r, ())) for r in ids},
            scheduled_spec_decode_tokens={r: drafts[r] for r in ids if drafts.get(r)},
            finished_req_ids=aborted, total_num_scheduled_tokens=len(ids), num_spec_tokens_to_schedule=MAX_K,
        )  # fmt: skip
        hooks.before_schedule(sched)
        if hasattr(sched, "finished_req_ids"):
            sched.finished_req_ids = set()  # vLLM starts a new set with each schedule
        hooks.after_schedule(sched, so)
        aborted = set()
        before = hooks.before_update(sched, so)
        # Each request samples accepted+1 tokens of its draft's length, or nothing (a prefill chunk).
        gens: list[list[int]] = []
        for r in ids:
            d_len = len(drafts.get(r, ()))
            gens.append([] if rng.random() < 0.05 else
                        [rng.randrange(vocab) for _ in range(1 + rng.randrange(d_len + 1))])  # fmt: skip
        rows_ids, rows_gens, rows_drafted, rows_fin = [], [], [], []
        for r, g in zip(ids, gens, strict=True):
            reqs[r]._all_token_ids += g
            if g:
                done = rng.random() < 0.03 or len(reqs[r]._all_token_ids) > 380
                reqs[r].finished = done
                if done and hasattr(sched, "finished_req_ids"):
                    sched.finished_req_ids.add(r)
                rows_ids.append(r)
                rows_gens.append(g)
                rows_drafted.append(len(drafts.get(r, ())))
                rows_fin.append(done)
        mro = SimpleNamespace(sampled_token_ids=gens, req_id_to_index={r: i for i, r in enumerate(ids)})
        for r in [r for r in ids if reqs[r].finished]:
            del reqs[r]  # vLLM frees a finished request in update_from_output
        hooks.after_update(sched, so, mro, before)
        want = ref.after_update(rows_ids, rows_gens, rows_drafted, rows_fin, before)
        rec = link.records[-1]
        assert list(rec.request_id) == rows_ids
        got = (rec.method, rec.k, rec.accepted, rec.cf_ngram, rec.class_index)
        for name, g, w in zip(("method", "k", "accepted", "cf", "class"), got, want[:5], strict=True):
            assert g.tolist() == w.tolist(), f"step {step}: {name}"
        if composite:
            assert rec.ngram_proposal is not None
            assert rec.ngram_proposal.tolist() == want[5].tolist(), f"step {step}: proposal"
            proposals.extend(rec.ngram_proposal.tolist())
        else:
            assert rec.ngram_proposal is None
        assert rec.drafted.tolist() == rows_drafted and rec.finished.tolist() == rows_fin
        validate_batch(pb.StepReportBatch(sequence=1, steps=[rec.to_pb()]), c.engine, Limits())
        live = list(reqs)
        eagle = [[100 + i] * MAX_K for i in range(len(live))]
        chosen = hooks.choose_drafts(live, eagle)
        idle = {r for r, g in zip(ids, gens, strict=True) if not g}  # prefill chunks
        assert chosen == ref.choose(d, live, eagle, idle), f"step {step}: drafts"
        for r, dr in zip(live, chosen, strict=True):
            drafts[r] = [] if r in idle else dr  # vLLM drops a prefill chunk's draft
            if dr and dr[0] < 100:  # an n-gram draft: vLLM's rule on the request's history
                toks = np.array(reqs[r]._all_token_ids, dtype=np.int32)
                assert dr == match_ngram(toks, 1, 3, 400, MAX_K).tolist()[: len(dr)]
        for r in [r for r in reqs if rng.random() < 0.02]:  # aborted before the next schedule
            aborted.add(r)
            del reqs[r]
            ref.release(r)
        for r in set(drafts) - set(reqs):
            del drafts[r]
    assert len(link.records) > 150
    methods = np.concatenate([r.method for r in link.records])
    # The "code" class plans n-gram: verified where the composite drafter runs, never elsewhere.
    assert (METHOD_CODES[Method.NGRAM] in methods) == composite
    assert METHOD_CODES[Method.EAGLE3] in methods
    if composite:  # the proposals are the index's draft lengths: matches and misses both occur
        assert 0 in proposals and max(proposals) == MAX_K
