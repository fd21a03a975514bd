"""The fast loop: a per-request rule evaluated by the engine every step, vectorised over the batch.

The slow loop plans an arm per (traffic class, batch bucket); the rule may override the method for a
request from that request's own recent feedback. ``ngram_margin``: switch a request to n-gram while
its recent n-gram acceptance (verified or counterfactual) beats the planned method's by ``margin``
tokens per step, and back when it stops doing so. The K stays the planned one.

``ngram_span`` (the default's rule): n-gram pays off in bursts, while the text copies a span of the
prompt or of earlier output, and almost never outside one. A scored n-gram draft (verified, or the
counterfactual the engine computes on every request-step) that accepted ``s`` tokens of a draft not
cut short by K says the copied span reaches ``s`` tokens past that position; after the step advanced
``e`` tokens the next draft can expect ``s - e`` more, and a draft cut short by K says the span goes
on. The rule drafts n-gram with K set to that expected run while it is at least ``min_run`` tokens,
and the planned arm otherwise: EAGLE-3 between spans, n-gram inside them, per request and per step.

With the n-gram proposer's match (``ngram_proposal``: the draft length vLLM's n-gram proposer has for
each request before this step drafts, 0 = no match; engines that do not report it pass None and the
rule works as above), ``ngram_span`` never drafts n-gram where there is no match (it would accept 0)
and drafts it at a match unless the span is known to end right there: where the expected run is
known it keeps K = run (capped at the proposal); where the last scored draft says the position is
past any span it knew of (a fresh match: a new copy span), it drafts the whole proposal (at most
``fresh_k`` tokens when that is set). Between matches the planned arm drafts, with the slow loop's K
for the class and batch bucket: EAGLE-3 (or P-EAGLE) where n-gram has nothing to offer. In the
simulator a whole proposal beat the planned K at every concurrency tried (drift, c = 1/8/32).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from policies.arms import METHOD_CODES, METHODS_BY_CODE, Method
from policies.directive import Directive, RequestRule
from policies.observation import NOT_SCORED
from policies.params import Param, resolve

RULES: dict[str, Mapping[str, Param]] = {
    "none": {},
    "ngram_margin": {
        "margin": Param(0.5, "Accepted tokens per step by which n-gram must lead to take over.", 0.0, 64.0),
        "alpha": Param(0.3, "Weight of the newest step in the per-request moving averages.", 0.01, 1.0),
        "warmup_steps": Param(2, "Steps of feedback a request needs before the rule may switch it.", 0, 1000),
    },
    "ngram_span": {
        "min_run": Param(
            2.0, "Expected n-gram run (tokens) at which a request drafts with n-gram.", 1.0, 64.0
        ),
        "when_off": Param(1, "1: requests planned 'off' also draft n-gram inside a span; 0: never.", 0, 1),
        "alpha": Param(0.3, "Weight of the newest step in the per-request moving averages.", 0.01, 1.0),
        "fresh_k": Param(
            0,
            "Longest n-gram draft at a fresh proposer match (0: the whole proposal; needs the signal).",
            0,
            64,
        ),
    },
}

_NGRAM = METHOD_CODES[Method.NGRAM]
_OFF = METHOD_CODES[Method.OFF]


def validate_rule(kind: str, params: Mapping[str, Any], where: str = "rule") -> RequestRule:
    if kind not in RULES:
        raise ValueError(f"{where}.kind: unknown rule {kind!r} (known: {', '.join(sorted(RULES))})")
    return RequestRule(kind, resolve(RULES[kind], params, f"{where}.params"))


class FastLoop:
    """Per-request state and the rule, as the engine runs them each step.

    Rows are addressed by request id; state lives in numpy arrays indexed by a slot per live request.
    """

    def __init__(self, *, capacity: int = 1024) -> None:
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._ewma = np.zeros((capacity, len(Method)))  # accepted tokens per step, per method
        self._steps = np.zeros(capacity, dtype=np.int64)
        # Expected n-gram run at the request's next position (NaN: unknown; < 0: past the span it was
        # scored in, 0 after a scored draft: the span ends there), and the K it last drafted.
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
        ngram_proposal: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Method codes and K for each request of the next step.

        ``ngram_proposal``: per request, the n-gram proposer's draft length at its current position
        (0: no match), computed before this step drafts; None where the engine does not report it.
        """
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
            known = np.nan_to_num(run, nan=0.0) >= rule.params["min_run"]
            k_new = np.clip(np.nan_to_num(run, nan=1.0), 1, max_k)
            if ngram_proposal is None:
                switch = known
            else:
                prop = np.asarray(ngram_proposal)
                fresh = (prop > 0) & (np.isnan(run) | (run < 0))
                switch = (prop > 0) & (known | fresh)
                fk = int(rule.params.get("fresh_k", 0))
                k_new = np.where(fresh, float(fk if fk > 0 else max_k), k_new)
                k_new = np.clip(np.minimum(k_new, np.maximum(prop, 1)), 1, max_k)
            if not int(rule.params["when_off"]):
                switch &= methods != _OFF
            methods[switch] = _NGRAM
            ks[switch] = k_new[switch].astype(np.int32)
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
        self._run[s] = np.where(score == NOT_SCORED, np.nan, run)

    def _mix(self, s: np.ndarray, col: np.ndarray, x: np.ndarray, alpha: float) -> None:
        old = self._ewma[s, col]
        self._ewma[s, col] = np.where(np.isnan(old), x, (1 - alpha) * old + alpha * x)

    def estimate(self, request_id: str, method: Method) -> float:
        s = self._slot.get(request_id)
        return float("nan") if s is None else float(self._ewma[s, METHOD_CODES[method]])


def method_names(codes: np.ndarray) -> list[str]:
    return [METHODS_BY_CODE[int(c)].value for c in codes]
