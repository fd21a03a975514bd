"""The stepwise replay engine: continuous batching on a virtual clock, the policy deciding live.

Each engine step: admit requests into free slots (closed loop: the next request of the trace as
soon as a slot frees; open loop: requests whose arrival time has passed, up to the concurrency cap),
prefill them (their first output token), and run one decode step for every other running request.
The policy decides exactly as in the sidecar and the plugin: ``ControlLoop.decide(now)`` on its own
cadence of the virtual clock (the slow loop's Directive), ``FastLoop.plan`` for every request every
step (the per-request rule), the engine model's constraints on top, then ``ControlLoop.observe`` and
``FastLoop.feedback`` with the feedback that engine returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from policies.arms import METHOD_CODES, Method
from policies.engine import Granularity
from policies.loop import ControlLoop
from policies.observation import NOT_SCORED, StepObservation
from policies.rules import FastLoop
from policies.spec import PolicySpec
from sim.costmodel import Profile
from sim.engines import EngineModel
from sim.run import ARM_CODE_BASE, RunResult, Timeline, arm_code
from sim.trace import Trace

_OFF = METHOD_CODES[Method.OFF]
_E3 = METHOD_CODES[Method.EAGLE3]
_PE = METHOD_CODES[Method.P_EAGLE]
_NG = METHOD_CODES[Method.NGRAM]

Progress = Callable[[int], None]


class Replayer:
    """One policy on one trace at one concurrency (or open loop with a concurrency cap)."""

    def __init__(
        self,
        *,
        trace: Trace,
        profile: Profile,
        engine: EngineModel,
        policy: PolicySpec,
        concurrency: int,
        open_loop: bool = False,
        seed: int | None = None,
        label: str = "",
        progress: Progress | None = None,
        loop_state: Mapping[str, Any] | None = None,
        ngram_signal: bool = True,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if open_loop and not trace.has_arrivals:
            raise ValueError(f"trace {trace.name!r}: open loop needs arrival_s on every request")
        missing = [m for m in engine.methods if m not in trace.acc]
        if missing:
            raise ValueError(
                f"engine {engine.name!r} drafts with {missing[0].value}, which trace {trace.name!r} lacks"
            )
        self.trace = trace
        self.profile = profile
        self.engine = engine
        self.policy = policy
        self.concurrency = concurrency
        self.open_loop = open_loop
        self.seed = seed
        self.label = label or policy.name
        self.progress = progress
        #: A ControlLoop state to start from (a warm start); the loop's state after ``run`` is kept.
        self.loop_state = loop_state
        self.final_state: dict[str, Any] | None = None
        #: Show the policy the trace's ``ngram_proposal`` (False: replay as if the engine had no signal).
        self.ngram_signal = ngram_signal

    def run(self) -> RunResult:
        tr, prof, eng = self.trace, self.profile, self.engine
        max_k = tr.max_k
        loop = ControlLoop(spec=self.policy, engine=eng.info(max_k), seed=self.seed)
        if self.loop_state is not None:
            loop.load_state_dict(self.loop_state)
        fast = FastLoop(capacity=max(64, 2 * self.concurrency))
        rule_alpha = float(self.policy.rule.params.get("alpha", 0.3))
        n, C = tr.n, self.concurrency
        base_all = tr.offsets[:-1]
        out_all = tr.output_tokens
        prompt_all = tr.prompt_tokens
        ids, classes = tr.ids, tr.classes
        acc_by_code = {METHOD_CODES[m]: a for m, a in tr.acc.items()}
        cf_methods = [(m, METHOD_CODES[m], tr.acc[m]) for m in eng.counterfactual if m in tr.acc]
        head = next((m for m in eng.always_runs if m in tr.acc), None) if eng.head_first_position else None
        head_code = METHOD_CODES[head] if head is not None else -1
        # The head's first position is exact for drafts of one token only.
        head_depth = {head: 1} if head is not None else {}
        batch_k = eng.granularity is Granularity.BATCH_STEP
        per_request_k = eng.granularity is Granularity.REQUEST_K
        primary = METHOD_CODES[eng.primary]
        playable = np.zeros(len(Method), dtype=bool)
        for m in eng.methods:
            playable[METHOD_CODES[m]] = True
        e3_always = Method.EAGLE3 in eng.always_runs
        # The n-gram proposer's match per position: the engine has it before drafting (causal), where
        # it runs the proposer (an engine that drafts n-gram per request) and the trace recorded it.
        proposal_all = (
            tr.ngram_proposal if self.ngram_signal and Method.NGRAM in eng.methods and not batch_k else None
        )
        pe_always = Method.P_EAGLE in eng.always_runs

        order = np.argsort(tr.arrival_s, kind="stable") if self.open_loop else np.arange(n)
        arrival = tr.arrival_s[order] if self.open_loop else np.zeros(n)
        submit = np.zeros(n)
        first = np.zeros(n)
        finish = np.zeros(n)
        # The running (decoding) requests, as parallel arrays rebuilt only when membership changes.
        m_req = np.zeros(0, dtype=np.int64)
        m_done = np.zeros(0, dtype=np.int64)
        m_out = m_prompt = m_base = m_req
        m_ids: list[str] = []
        m_cls: list[str] = []
        nxt = 0
        clock = 0.0
        finished = 0
        steps = request_steps = drafted_total = accepted_total = switches = 0
        rounds_seen = 0
        tl_end: list[float] = []
        tl_emit: list[int] = []
        tl_draft: list[int] = []
        tl_acc: list[int] = []
        tl_arm: list[int] = []
        empty_i = np.zeros(0, dtype=np.int64)

        while finished < n:
            # -- admission ------------------------------------------------------------------------
            nd = len(m_req)
            room = C - nd
            take = 0
            if self.open_loop:
                while take < room and nxt + take < n and arrival[nxt + take] <= clock:
                    take += 1
                if nd == 0 and take == 0:
                    clock = max(clock, float(arrival[nxt]))
                    continue
            else:
                take = min(room, n - nxt)
            new_reqs = order[nxt : nxt + take]
            if take:
                submit[new_reqs] = arrival[nxt : nxt + take] if self.open_loop else clock
            nxt += take
            batch_size = nd + take
            queued = 0
            wait = 0.0
            if self.open_loop and nxt < n:
                queued = int(np.searchsorted(arrival, clock, side="right")) - nxt
                wait = clock - float(arrival[nxt]) if queued > 0 else 0.0

            # -- decide ---------------------------------------------------------------------------
            directive = loop.decide(clock)
            if loop.rounds != rounds_seen:
                rounds_seen = loop.rounds
                switches += sum(1 for c in loop.last_changes if c.before is not None)

            d = m_done
            prop: np.ndarray | None = None
            if nd:
                pos = m_base + d - 1
                if batch_k:
                    # One K for the whole step: the per-request rule has nothing to act on.
                    kk = directive.k_for_batch(batch_size, max_k)
                    code = primary if kk > 0 else _OFF
                    methods = np.full(nd, code, dtype=np.int8)
                    ks = np.full(nd, kk, dtype=np.int64)
                    a = acc_by_code[code][pos] if kk > 0 else empty_i
                    e = (
                        np.minimum(np.minimum(a, kk) + 1, m_out - d)
                        if kk > 0
                        else np.ones(nd, dtype=np.int64)
                    )
                else:
                    prop = proposal_all[pos] if proposal_all is not None else None
                    methods, ks32 = fast.plan(directive, m_ids, m_cls, batch_size, max_k, ngram_proposal=prop)
                    ks = ks32.astype(np.int64)
                    if per_request_k:
                        methods = np.where(ks > 0, primary, _OFF).astype(np.int8)
                    else:
                        methods = np.where(playable[methods], methods, primary).astype(np.int8)
                    off = (methods == _OFF) | (ks <= 0)
                    if off.any():
                        methods[off] = _OFF
                        ks[off] = 0
                    a = np.zeros(nd, dtype=np.int64)
                    for code_m, arr in acc_by_code.items():
                        sel = methods == code_m
                        if sel.any():
                            a[sel] = arr[pos[sel]]
                    e = np.minimum(np.minimum(a, ks) + 1, m_out - d)
                ksum = int(ks.sum())
            else:
                methods = np.zeros(0, dtype=np.int8)
                ks = e = pos = empty_i
                ksum = 0

            # -- price the step -------------------------------------------------------------------
            kv = float((m_prompt + d).sum()) if nd else 0.0
            batched = float(ksum + nd + (prompt_all[new_reqs].sum() if take else 0))
            if batch_k:
                mk = int(ks[0]) if nd else 0
                is_e3 = nd > 0 and mk > 0 and methods[0] == _E3
                is_pe = nd > 0 and mk > 0 and methods[0] == _PE
                is_ng = nd > 0 and mk > 0 and methods[0] == _NG
                eagle_fwd = float(mk) if is_e3 else 0.0
                e3_spec = float(ksum) if is_e3 else 0.0
                pe_spec = float(ksum) if is_pe else 0.0
                pe_used = is_pe
            else:
                e3 = methods == _E3
                pe = methods == _PE
                any_e3 = bool(e3.any())
                eagle_fwd = float(ks[e3].max()) if any_e3 else 0.0
                e3_spec = float(ks[e3].sum()) if any_e3 else 0.0
                pe_used = bool(pe.any())
                pe_spec = float(ks[pe].sum()) if pe_used else 0.0
                is_ng = bool((methods == _NG).any())
            if e3_always:
                eagle_fwd = max(eagle_fwd, 1.0)
            pe_pass = 1.0 if (pe_used or pe_always) else 0.0
            dt = prof.step_time_one(kv, batched, eagle_fwd, e3_spec, pe_pass, pe_spec, float(is_ng))
            clock += dt
            steps += 1

            # -- feedback -------------------------------------------------------------------------
            if nd:
                accepted = e - 1
                acc_sum = int(accepted.sum())
                cf: dict[Method, np.ndarray] = {}
                if cf_methods:
                    # A draft of max_k scored against the tokens that follow (the plugin can score it
                    # once they exist, at most max_k tokens later; that delay is not modelled).
                    for m, code_m, arr in cf_methods:
                        v = np.minimum(arr[pos], max_k).astype(np.int32)
                        v[methods == code_m] = NOT_SCORED
                        cf[m] = v
                if head is not None:
                    hv = cf[head] if head in cf else np.minimum(tr.acc[head][pos], 1).astype(np.int32)
                    hv[methods == head_code] = NOT_SCORED
                    cf[head] = hv
                ks32o = ks.astype(np.int32)
                obs = StepObservation(
                    time_s=clock,
                    duration_s=dt,
                    batch_size=batch_size,
                    queue_length=queued,
                    queue_wait_s=wait,
                    traffic_class=tuple(m_cls),
                    method=methods,
                    k=ks32o,
                    drafted=ks32o,
                    accepted=accepted.astype(np.int32),
                    counterfactual=cf,
                    request_id=tuple(m_ids),
                    counterfactual_depth=head_depth,
                    prefill_tokens=int(prompt_all[new_reqs].sum()) if take else 0,
                    ngram_proposal=prop,
                )
                loop.observe(obs)
                if not batch_k:
                    fast.feedback(m_ids, methods, accepted, cf, alpha=rule_alpha, depth=head_depth)
                request_steps += nd
                drafted_total += ksum
                accepted_total += acc_sum
                m_done = d + e
                if batch_k:
                    tl_arm.append(int(methods[0]) * ARM_CODE_BASE + int(ks[0]))
                else:
                    codes = arm_code(methods, ks)
                    tl_arm.append(int(np.bincount(codes).argmax()) if nd > 1 else int(codes[0]))
                tl_draft.append(ksum)
                tl_acc.append(acc_sum)
                tl_emit.append(acc_sum + nd + take)
            else:
                tl_arm.append(-1)
                tl_draft.append(0)
                tl_acc.append(0)
                tl_emit.append(take)
            tl_end.append(clock)

            # -- completions and joins ------------------------------------------------------------
            changed = False
            if nd:
                ended = m_done >= m_out
                if ended.any():
                    fin = m_req[ended]
                    finish[fin] = clock
                    finished += len(fin)
                    if not batch_k:
                        for i in fin:
                            fast.release(ids[i])
                    if self.progress is not None:
                        self.progress(int(out_all[fin].sum()))
                    keep = ~ended
                    m_req, m_done = m_req[keep], m_done[keep]
                    changed = True
            if take:
                first[new_reqs] = clock
                single = out_all[new_reqs] <= 1
                if single.any():
                    fin = new_reqs[single]
                    finish[fin] = clock
                    finished += len(fin)
                    if self.progress is not None:
                        self.progress(int(out_all[fin].sum()))
                joining = new_reqs[~single]
                m_req = np.concatenate([m_req, joining])
                m_done = np.concatenate([m_done, np.ones(len(joining), dtype=np.int64)])
                changed = True
            if changed:
                m_out, m_prompt, m_base = out_all[m_req], prompt_all[m_req], base_all[m_req]
                m_ids = [ids[i] for i in m_req]
                m_cls = [classes[i] for i in m_req]

        self.final_state = loop.state_dict()
        return RunResult(
            label=self.label,
            engine=eng.name,
            concurrency=C,
            open_loop=self.open_loop,
            submit_s=submit,
            first_token_s=first,
            finish_s=finish,
            output_tokens=out_all.copy(),
            steps=steps,
            request_steps=request_steps,
            drafted=drafted_total,
            accepted=accepted_total,
            switches=switches,
            timeline=Timeline(
                np.array(tl_end), np.array(tl_emit), np.array(tl_draft), np.array(tl_acc), np.array(tl_arm)
            ),
        )
