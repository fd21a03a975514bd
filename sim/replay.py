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

from collections.abc import Callable

import numpy as np

from policies.arms import METHOD_CODES, Method
from policies.engine import Granularity
from policies.loop import ControlLoop
from policies.observation import NOT_SCORED, StepObservation
from policies.rules import FastLoop
from policies.spec import PolicySpec
from sim.costmodel import Profile
from sim.engines import EngineModel
from sim.run import RunResult, Timeline, arm_code
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

    def run(self) -> RunResult:
        tr, prof, eng = self.trace, self.profile, self.engine
        max_k = tr.max_k
        loop = ControlLoop(spec=self.policy, engine=eng.info(max_k), seed=self.seed)
        fast = FastLoop(capacity=max(64, 2 * self.concurrency))
        rule_alpha = float(self.policy.rule.params.get("alpha", 0.3))
        n, C = tr.n, self.concurrency
        base = tr.offsets[:-1]
        out = tr.output_tokens
        prompt = tr.prompt_tokens
        ids, classes = tr.ids, tr.classes
        acc_by_code = {METHOD_CODES[m]: a for m, a in tr.acc.items()}
        cf_methods = [m for m in eng.counterfactual if m in tr.acc]
        head = next((m for m in eng.always_runs if m in tr.acc), None) if eng.head_first_position else None
        batch_k = eng.granularity is Granularity.BATCH_STEP
        primary = METHOD_CODES[eng.primary]

        order = np.argsort(tr.arrival_s, kind="stable") if self.open_loop else np.arange(n)
        arrival = tr.arrival_s[order] if self.open_loop else np.zeros(n)
        submit = np.zeros(n)
        first = np.zeros(n)
        finish = np.zeros(n)
        slot_req = np.full(C, -1, dtype=np.int64)
        done = np.zeros(C, dtype=np.int64)
        nxt = 0
        clock = 0.0
        finished = 0
        steps = request_steps = drafted_total = accepted_total = switches = 0
        tl_end: list[float] = []
        tl_emit: list[int] = []
        tl_draft: list[int] = []
        tl_acc: list[int] = []
        tl_arm: list[int] = []
        rounds_seen = 0

        while finished < n:
            # -- admission ------------------------------------------------------------------------
            free = np.flatnonzero(slot_req < 0)
            running = C - len(free)
            take = 0
            if self.open_loop:
                while take < len(free) and nxt + take < n and arrival[nxt + take] <= clock:
                    take += 1
                if running == 0 and take == 0:
                    clock = max(clock, float(arrival[nxt]))
                    continue
            else:
                take = min(len(free), n - nxt)
            dec_slots = np.flatnonzero(slot_req >= 0)
            new_slots = free[:take]
            new_reqs = order[nxt : nxt + take]
            nxt += take
            slot_req[new_slots] = new_reqs
            submit[new_reqs] = arrival[nxt - take : nxt] if self.open_loop else clock
            batch_size = len(dec_slots) + take
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

            r = slot_req[dec_slots]
            d = done[dec_slots]
            nd = len(r)
            rid = [ids[i] for i in r]
            rcls = [classes[i] for i in r]
            if nd:
                if batch_k:
                    # One K for the whole step: the per-request rule has nothing to act on.
                    kk = directive.k_for_batch(batch_size, max_k)
                    methods = np.full(nd, primary if kk > 0 else _OFF, dtype=np.int8)
                    ks = np.full(nd, kk, dtype=np.int64)
                else:
                    methods, ks = fast.plan(directive, rid, rcls, batch_size, max_k)
                    ks = ks.astype(np.int64)
                    if eng.granularity is Granularity.REQUEST_K:
                        methods = np.where(ks > 0, primary, _OFF).astype(np.int8)
                    else:
                        playable = np.isin(methods, [METHOD_CODES[m] for m in eng.methods])
                        methods = np.where(playable, methods, primary).astype(np.int8)
                off = (methods == _OFF) | (ks <= 0)
                methods = np.where(off, _OFF, methods).astype(np.int8)
                ks = np.where(off, 0, ks)
                pos = base[r] + d - 1
                a = np.zeros(nd, dtype=np.int64)
                for code, arr in acc_by_code.items():
                    sel = methods == code
                    if sel.any():
                        a[sel] = arr[pos[sel]]
                e = np.minimum(np.minimum(a, ks) + 1, out[r] - d)
            else:
                methods = np.zeros(0, dtype=np.int8)
                ks = e = pos = np.zeros(0, dtype=np.int64)

            # -- price the step -------------------------------------------------------------------
            kv = float((prompt[r] + d).sum())
            batched = float((ks + 1).sum() + prompt[new_reqs].sum())
            e3 = methods == _E3
            pe = methods == _PE
            eagle_fwd = float(ks[e3].max()) if e3.any() else 0.0
            if Method.EAGLE3 in eng.always_runs:
                eagle_fwd = max(eagle_fwd, 1.0)
            pe_pass = 1.0 if (pe.any() or Method.P_EAGLE in eng.always_runs) else 0.0
            dt = prof.step_time_one(
                kv,
                batched,
                eagle_fwd,
                float(ks[e3].sum()),
                pe_pass,
                float(ks[pe].sum()),
                float((methods == _NG).any()),
            )
            clock += dt
            steps += 1

            # -- feedback -------------------------------------------------------------------------
            if nd:
                accepted = e - 1
                cf: dict[Method, np.ndarray] = {}
                for m in cf_methods:
                    code = METHOD_CODES[m]
                    kref = np.where(ks > 0, ks, max_k)
                    v = np.minimum(tr.acc[m][pos], kref).astype(np.int32)
                    cf[m] = np.where(methods == code, NOT_SCORED, v).astype(np.int32)
                if head is not None:
                    code = METHOD_CODES[head]
                    v = np.minimum(tr.acc[head][pos], 1).astype(np.int32)
                    prev = cf.get(head)
                    cf[head] = np.where(methods == code, NOT_SCORED, v if prev is None else prev).astype(
                        np.int32
                    )
                obs = StepObservation(
                    time_s=clock,
                    duration_s=dt,
                    batch_size=batch_size,
                    queue_length=queued,
                    queue_wait_s=wait,
                    traffic_class=tuple(rcls),
                    method=methods,
                    k=ks.astype(np.int32),
                    drafted=ks.astype(np.int32),
                    accepted=accepted.astype(np.int32),
                    counterfactual=cf,
                    request_id=tuple(rid),
                )
                loop.observe(obs)
                if not batch_k:
                    fast.feedback(rid, methods, accepted, cf, alpha=rule_alpha)
                request_steps += nd
                drafted_total += int(ks.sum())
                accepted_total += int(accepted.sum())
                done[dec_slots] = d + e
                codes = arm_code(methods, ks)
                tl_arm.append(int(np.bincount(codes).argmax()) if nd > 1 else int(codes[0]))
                tl_draft.append(int(ks.sum()))
                tl_acc.append(int(accepted.sum()))
                tl_emit.append(int(e.sum()) + take)
            else:
                tl_arm.append(-1)
                tl_draft.append(0)
                tl_acc.append(0)
                tl_emit.append(take)
            tl_end.append(clock)
            if take:
                first[new_reqs] = clock
                done[new_slots] = 1
            # -- completions ----------------------------------------------------------------------
            occupied = slot_req >= 0
            ended = np.flatnonzero(occupied & (done >= out[np.maximum(slot_req, 0)]))
            if len(ended):
                fin = slot_req[ended]
                finish[fin] = clock
                if not batch_k:
                    for i in fin:
                        fast.release(ids[i])
                slot_req[ended] = -1
                finished += len(ended)
                if self.progress is not None:
                    self.progress(int(out[fin].sum()))

        return RunResult(
            label=self.label,
            engine=eng.name,
            concurrency=C,
            open_loop=self.open_loop,
            submit_s=submit,
            first_token_s=first,
            finish_s=finish,
            output_tokens=out.copy(),
            steps=steps,
            request_steps=request_steps,
            drafted=drafted_total,
            accepted=accepted_total,
            switches=switches,
            timeline=Timeline(
                np.array(tl_end), np.array(tl_emit), np.array(tl_draft), np.array(tl_acc), np.array(tl_arm)
            ),
        )
