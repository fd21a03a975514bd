"""The fast loop's per-request rule; its kernels (compiled and not) against the numpy version they replaced."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import METHOD_CODES, Arm, Method
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.observation import NOT_SCORED
from policies.rules import FastLoop, method_names, validate_rule
from tests.policies.directives import make_directive

_NGRAM = METHOD_CODES[Method.NGRAM]
_OFF = METHOD_CODES[Method.OFF]

NG = METHOD_CODES[Method.NGRAM]
EA = METHOD_CODES[Method.EAGLE3]


def directive(rule: RequestRule, k: int = 3) -> Directive:
    return make_directive(
        k_table=(KRange(1, 0, k),),
        plan=(PlanEntry("*", 1, 0, Arm(Method.EAGLE3, k)), PlanEntry("code", 1, 0, Arm(Method.EAGLE3, 2))),
        rule=rule,
    )


def test_plan_reads_the_directive_per_class_and_clamps_k() -> None:
    fl = FastLoop()
    m, k = fl.plan(directive(RequestRule(), k=6), ["a", "b"], ["chat", "code"], 2, max_k=4)
    assert method_names(m) == ["eagle3", "eagle3"] and k.tolist() == [4, 2]


def test_ngram_margin_switches_requests_whose_ngram_leads_and_back() -> None:
    rule = RequestRule("ngram_margin", {"margin": 0.5, "alpha": 1.0, "warmup_steps": 1})
    fl = FastLoop()
    d = directive(rule)
    ids = ["copying", "chatting"]
    m, _ = fl.plan(d, ids, ["chat", "chat"], 2, 4)
    assert (m == EA).all()  # no feedback yet
    fl.feedback(ids, m, np.array([1, 2]), {Method.NGRAM: np.array([3, 0])}, alpha=1.0)
    m, _ = fl.plan(d, ids, ["chat", "chat"], 2, 4)
    assert method_names(m) == ["ngram", "eagle3"]
    # n-gram stops matching for the first request: it goes back to the planned method.
    fl.feedback(ids, m, np.array([0, 2]), {Method.NGRAM: np.array([NOT_SCORED, 0])}, alpha=1.0)
    m, _ = fl.plan(d, ids, ["chat", "chat"], 2, 4)
    assert method_names(m) == ["eagle3", "eagle3"]


def test_no_rule_never_overrides() -> None:
    fl = FastLoop()
    d = directive(RequestRule())
    fl.feedback(["r"], np.array([EA]), np.array([0]), {Method.NGRAM: np.array([4])})
    m, _ = fl.plan(d, ["r"], ["chat"], 1, 4)
    assert method_names(m) == ["eagle3"]


def test_slots_are_reused_and_grow() -> None:
    fl = FastLoop(capacity=2)
    ids = [f"r{i}" for i in range(5)]
    fl.feedback(ids, np.full(5, EA), np.arange(5), {})
    assert fl.estimate("r4", Method.EAGLE3) == 4.0
    fl.release("r0")
    fl.feedback(["new"], np.array([EA]), np.array([1]), {})
    assert fl.estimate("new", Method.EAGLE3) == 1.0 and np.isnan(fl.estimate("r0", Method.EAGLE3))


class NumpyFastLoop:
    """The fast loop as it was before its kernels: vectorised numpy, the reference."""

    def __init__(self, *, capacity: int = 1024) -> None:
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._ewma = np.zeros((capacity, len(Method)))  # accepted tokens per step, per method
        self._steps = np.zeros(capacity, dtype=np.int64)
        # Expected n-gram run at the request's next position (NaN: unknown), and the K it last drafted.
        self._run = np.full(capacity, np.nan)
        self._k = np.zeros(capacity, dtype=np.int64)
        self._max_k = 0

    def slots(self, request_ids: Sequence[str]) -> np.ndarray:
        out = np.empty(len(request_ids), dtype=np.int64)
        for j, rid in enumerate(request_ids):
            s = self._slot.get(rid)
            if s is None:
                s = self._free.pop() if self._free else len(self._slot)
                if s >= len(self._steps):
                    self._grow()
                self._slot[rid] = s
                self._ewma[s] = np.nan
                self._steps[s] = 0
                self._run[s] = np.nan
                self._k[s] = 0
            out[j] = s
        return out

    def _grow(self) -> None:
        n = len(self._steps)
        self._ewma = np.vstack([self._ewma, np.zeros((n, len(Method)))])
        self._steps = np.concatenate([self._steps, np.zeros(n, dtype=np.int64)])
        self._run = np.concatenate([self._run, np.full(n, np.nan)])
        self._k = np.concatenate([self._k, np.zeros(n, dtype=np.int64)])

    def release(self, request_id: str) -> None:
        s = self._slot.pop(request_id, None)
        if s is not None:
            self._free.append(s)

    def plan(
        self,
        directive: Directive,
        request_ids: Sequence[str],
        traffic_classes: Sequence[str],
        batch_size: int,
        max_k: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Method codes and K for each request of the next step."""
        n = len(request_ids)
        methods = np.empty(n, dtype=np.int8)
        ks = np.empty(n, dtype=np.int32)
        by_class: dict[str, tuple[int, int]] = {}
        for j, c in enumerate(traffic_classes):
            mk = by_class.get(c)
            if mk is None:
                arm = directive.arm_for(c, batch_size)
                mk = by_class[c] = (METHOD_CODES[arm.method], min(arm.k, max_k))
            methods[j], ks[j] = mk
        rule = directive.rule
        if rule.kind == "ngram_margin" and n:
            s = self.slots(request_ids)
            ng = self._ewma[s, _NGRAM]
            planned = self._ewma[s, methods.astype(np.int64)]
            ready = self._steps[s] >= int(rule.params["warmup_steps"])
            lead = np.nan_to_num(ng, nan=-np.inf) >= np.nan_to_num(planned, nan=0.0) + rule.params["margin"]
            switch = ready & lead & (methods != _OFF) & (ks > 0)
            methods[switch] = _NGRAM
        elif rule.kind == "ngram_span" and n:
            s = self.slots(request_ids)
            run = self._run[s]
            switch = np.nan_to_num(run, nan=0.0) >= rule.params["min_run"]
            if not int(rule.params["when_off"]):
                switch &= methods != _OFF
            methods[switch] = _NGRAM
            ks[switch] = np.clip(run[switch], 1, max_k).astype(np.int32)
        if n and rule.kind != "none":
            self._max_k = max_k
            self._k[self.slots(request_ids)] = np.where(methods == _OFF, 0, ks)
        return methods, ks

    def feedback(
        self,
        request_ids: Sequence[str],
        methods: np.ndarray,
        accepted: np.ndarray,
        counterfactual: Mapping[Method, np.ndarray],
        alpha: float = 0.3,
        depth: Mapping[Method, int] | None = None,
    ) -> None:
        """Fold one step's verified and counterfactual accepted counts into the moving averages.

        Counterfactuals with a limited ``depth`` (e.g. an EAGLE head's first position) are not on the
        same scale as full drafts, so they stay out of the averages the rule compares.
        """
        if not len(request_ids):
            return
        s = self.slots(request_ids)
        self._steps[s] += 1
        verified = methods != _OFF
        self._mix(s[verified], methods[verified].astype(np.int64), accepted[verified], alpha)
        for m, cf in counterfactual.items():
            if depth and m in depth:
                continue
            ok = cf != NOT_SCORED
            col = np.full(int(ok.sum()), METHOD_CODES[m], dtype=np.int64)
            self._mix(s[ok], col, cf[ok], alpha)
        self._span(s, methods, np.asarray(accepted), counterfactual.get(Method.NGRAM))

    def _span(self, s: np.ndarray, methods: np.ndarray, accepted: np.ndarray, cf: np.ndarray | None) -> None:
        """The expected n-gram run at each request's next position (see ``ngram_span``)."""
        max_k = self._max_k
        if max_k <= 0:
            return
        ng = methods == _NGRAM
        score = np.where(ng, accepted, NOT_SCORED)
        cut = ng & (accepted >= self._k[s])  # the draft ended at K, not at a rejection
        if cf is not None:
            from_cf = ~ng & (cf != NOT_SCORED)
            score = np.where(from_cf, cf, score)
            cut |= from_cf & (cf >= max_k)
        step = np.where(methods == _OFF, 0, accepted) + 1
        run = np.where(cut, float(max_k), score.astype(np.float64) - step)
        self._run[s] = np.where(score == NOT_SCORED, np.nan, np.maximum(run, 0.0))

    def _mix(self, s: np.ndarray, col: np.ndarray, x: np.ndarray, alpha: float) -> None:
        old = self._ewma[s, col]
        self._ewma[s, col] = np.where(np.isnan(old), x, (1 - alpha) * old + alpha * x)

    def estimate(self, request_id: str, method: Method) -> float:
        s = self._slot.get(request_id)
        return float("nan") if s is None else float(self._ewma[s, METHOD_CODES[method]])


@pytest.mark.usefixtures("kernels")
@settings(max_examples=60, deadline=None)
@given(
    rule=st.sampled_from(["none", "ngram_margin", "ngram_span"]),
    when_off=st.integers(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernels_plan_and_learn_as_the_numpy_loop(rule: str, when_off: int, seed: int) -> None:
    """Hundreds of steps of a changing batch (arrivals, departures, slot reuse past the capacity),
    random verified and counterfactual counts: the same plans and the same per-request estimates."""
    rng = np.random.default_rng(seed)
    params = {"ngram_margin": {"warmup_steps": 1, "margin": 0.5}, "ngram_span": {"when_off": when_off}}
    d = directive(validate_rule(rule, params.get(rule, {})), k=3)
    new, ref = FastLoop(capacity=2), NumpyFastLoop(capacity=2)
    live: list[str] = []
    serial = 0
    for _ in range(200):
        for _ in range(int(rng.integers(0, 3))):
            live.append(f"r{serial}")
            serial += 1
        if not live:
            continue
        classes = [("chat", "code")[int(c)] for c in rng.integers(0, 2, len(live))]
        m1, k1 = new.plan(d, live, classes, len(live), 4)
        m2, k2 = ref.plan(d, live, classes, len(live), 4)
        assert m1.tolist() == m2.tolist() and k1.tolist() == k2.tolist()
        off = rng.random(len(live)) < 0.1
        methods = np.where(off, _OFF, m1).astype(np.int8)
        accepted = np.where(off, 0, rng.integers(0, 5, len(live))).astype(np.int32)
        cf = np.where(rng.random(len(live)) < 0.3, NOT_SCORED, rng.integers(0, 5, len(live))).astype(np.int32)
        new.feedback(live, methods, accepted, {Method.NGRAM: cf}, alpha=0.3)
        ref.feedback(live, methods, accepted, {Method.NGRAM: cf}, alpha=0.3)
        for r in live:
            for m in (Method.NGRAM, Method.EAGLE3):
                a, b = new.estimate(r, m), ref.estimate(r, m)
                assert a == pytest.approx(b, nan_ok=True)
        for r in [r for r in live if rng.random() < 0.1]:
            live.remove(r)
            new.release(r)
            ref.release(r)
