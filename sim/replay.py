"""The stepwise replay engine: continuous batching on a virtual clock, the policy deciding live.

Each engine step: admit requests into free slots (closed loop: the next request of the trace as
soon as a slot frees; open loop: requests whose arrival time has passed, up to the concurrency cap),
prefill them (their first output token), and run one decode step for every other running request.
The step itself (plan, clamp, acceptance, price, the per-request rule's feedback) is
``sim.kernel.StepKernel``'s, the same one the demo engine runs; this module keeps the scheduling.
The policy decides exactly as in the sidecar and the plugin: ``ControlLoop.decide(now)`` on its own
cadence of the virtual clock (the slow loop's Directive), then ``ControlLoop.observe`` with the
feedback that engine returns, its traffic classes bounded by the sidecar's rule
(``policies.classes.ClassBound``: those beyond an engine's first 256 pooled into ``default``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from policies.classes import ClassBound
from policies.engine import Granularity
from policies.loop import ControlLoop
from policies.observation import StepBatch, StepObservation
from policies.rules import FastLoop
from policies.spec import PolicySpec
from sim.costmodel import Profile
from sim.engines import EngineModel
from sim.kernel import StepKernel, check_engine
from sim.run import ARM_CODE_BASE, RunResult, Timeline, arm_code
from sim.trace import Trace

Progress = Callable[[int], None]


def needs_plugin(policy: PolicySpec) -> bool:
    """Whether an engine runs the controller plugin under ``policy`` (and pays its cost per step): a
    static arm without a per-request rule is a plain vLLM configured once; anything else is driven."""
    return policy.algorithm != "static" or policy.rule.kind != "none"


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
        check_engine(trace, engine)
        self.trace = trace
        self.profile = profile
        self.engine = engine
        self.policy = policy
        self.concurrency = concurrency
        self.open_loop = open_loop
        self.seed = seed
        self.label = label or policy.name
        self.progress = progress
        #: Another loop's state to warm-start from, taken as a sidecar takes a fleet donor's
        #: (``ControlLoop.load_learned``: its learned tables, not its clock, round or generator); the
        #: loop's state after ``run`` is kept in ``final_state``.
        self.loop_state = loop_state
        self.final_state: dict[str, Any] | None = None
        #: Show the policy the trace's ``ngram_proposal`` (False: replay as if the engine had no signal).
        self.ngram_signal = ngram_signal

    def run(self) -> RunResult:
        tr, eng = self.trace, self.engine
        loop = ControlLoop(spec=self.policy, engine=eng.info(tr.max_k), seed=self.seed)
        if self.loop_state is not None:
            loop.load_learned(self.loop_state)
        kernel = StepKernel(
            trace=tr,
            profile=self.profile,
            engine=eng,
            fast=FastLoop(capacity=max(64, 2 * self.concurrency)),
            ngram_signal=self.ngram_signal,
            controlled=needs_plugin(self.policy),
        )
        # The sidecar pools an engine's classes beyond its bound before its loop learns from them.
        class_bound = ClassBound()
        n, C = tr.n, self.concurrency
        out_all = tr.output_tokens
        batch_k = eng.granularity is Granularity.BATCH_STEP

        order = np.argsort(tr.arrival_s, kind="stable") if self.open_loop else np.arange(n)
        arrival = tr.arrival_s[order] if self.open_loop else np.zeros(n)
        submit = np.zeros(n)
        first = np.zeros(n)
        finish = np.zeros(n)
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

        while finished < n:
            # -- admission ------------------------------------------------------------------------
            nd = kernel.running
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
            queued = 0
            wait = 0.0
            if self.open_loop and nxt < n:
                queued = int(np.searchsorted(arrival, clock, side="right")) - nxt
                wait = clock - float(arrival[nxt]) if queued > 0 else 0.0

            # -- decide, then step ------------------------------------------------------------------
            directive = loop.decide(clock)
            if loop.rounds != rounds_seen:
                rounds_seen = loop.rounds
                switches += sum(1 for c in loop.last_changes if c.before is not None)
            st = kernel.step(directive, new_reqs)
            dt = st.duration_s
            clock += dt
            steps += 1

            # -- feedback -------------------------------------------------------------------------
            if nd:
                acc_sum = int(st.accepted.sum())
                ksum = st.drafted
                ks32o = st.k.astype(np.int32)
                obs = StepObservation(
                    time_s=clock,
                    duration_s=dt,
                    batch_size=st.batch_size,
                    queue_length=queued,
                    queue_wait_s=wait,
                    traffic_class=st.classes,
                    method=st.method,
                    k=ks32o,
                    drafted=ks32o,
                    accepted=st.accepted.astype(np.int32),
                    counterfactual=st.counterfactual,
                    request_id=st.ids,
                    counterfactual_depth=kernel.counterfactual_depth,
                    prefill_tokens=st.prefill_tokens,
                    ngram_proposal=st.ngram_proposal,
                )
                # production's path: a report of one step, its classes bounded as the sidecar does
                loop.observe(class_bound.apply(StepBatch.of(obs)))
                request_steps += nd
                drafted_total += ksum
                accepted_total += acc_sum
                if batch_k:
                    tl_arm.append(int(st.method[0]) * ARM_CODE_BASE + int(st.k[0]))
                else:
                    codes = arm_code(st.method, st.k)
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
            if len(st.finished):
                finish[st.finished] = clock
                finished += len(st.finished)
                if self.progress is not None:
                    self.progress(int(out_all[st.finished].sum()))
            if take:
                first[new_reqs] = clock

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
