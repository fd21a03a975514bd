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

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from policies.arms import METHOD_CODES, METHODS_BY_CODE, Method
from policies.directive import Directive, RequestRule
from policies.jit import kernel
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


_NO_RULE, _MARGIN, _SPAN = 0, 1, 2
_RULE_CODES = {"none": _NO_RULE, "ngram_margin": _MARGIN, "ngram_span": _SPAN}


def rule_args(directive: Directive) -> tuple[int, float, float, float]:
    """The directive's rule as ``plan_row`` reads it: (code, p0, p1, p2)."""
    rule = directive.rule
    code = _RULE_CODES[rule.kind]
    p = rule.params
    if code == _MARGIN:
        return code, float(p["margin"]), float(p["warmup_steps"]), 0.0
    if code == _SPAN:
        return code, float(p["min_run"]), float(p["when_off"]), float(p.get("fresh_k", 0))
    return code, 0.0, 0.0, 0.0


@kernel
def plan_row(
    ewma: np.ndarray,
    steps: np.ndarray,
    run: np.ndarray,
    last_k: np.ndarray,
    i: int,
    m: int,
    k: int,
    rule: int,
    p0: float,
    p1: float,
    p2: float,
    prop: int,
    max_k: int,
) -> tuple[int, int]:
    """The rule's override of slot ``i``'s planned (method, K); records the K drafted.

    ngram_margin (p0 margin, p1 warm-up steps): n-gram where its average leads the planned method's
    by the margin. ngram_span (p0 min_run, p1 when_off, p2 fresh_k): n-gram, K = the expected run,
    inside a span; ``prop`` is the n-gram proposer's draft length here (0: no match, < 0: not
    reported), which gates the switch and opens fresh spans (see the module's docstring)."""
    if rule == _NO_RULE:
        return m, k
    if rule == _MARGIN:
        ng = float(ewma[i, _NGRAM])
        planned = float(ewma[i, m])
        lead = (not math.isnan(ng)) and ng >= (0.0 if math.isnan(planned) else planned) + p0
        if int(steps[i]) >= p1 and lead and m != _OFF and k > 0:
            m = _NGRAM
    elif rule == _SPAN:
        r = float(run[i])
        unknown = math.isnan(r)
        known = (not unknown) and r >= p0
        k_new = min(max(1.0 if unknown else r, 1.0), float(max_k))
        if prop < 0:
            switch = known
        else:
            fresh = prop > 0 and (unknown or r < 0)
            switch = prop > 0 and (known or fresh)
            if fresh:
                k_new = p2 if p2 > 0 else float(max_k)
            k_new = min(max(min(k_new, float(max(prop, 1))), 1.0), float(max_k))
        if switch and (p1 != 0 or m != _OFF):
            m = _NGRAM
            k = int(k_new)
    last_k[i] = 0 if m == _OFF else k
    return m, k


@kernel
def _plan_rule(
    ewma: np.ndarray,
    steps: np.ndarray,
    run: np.ndarray,
    last_k: np.ndarray,
    s: np.ndarray,
    methods: np.ndarray,
    ks: np.ndarray,
    rule: int,
    p0: float,
    p1: float,
    p2: float,
    proposal: np.ndarray,
    max_k: int,
) -> None:
    for j in range(len(s)):
        m, k = plan_row(ewma, steps, run, last_k, int(s[j]), int(methods[j]), int(ks[j]), rule, p0, p1, p2,
                        int(proposal[j]), max_k)  # fmt: skip
        methods[j] = m
        ks[j] = k


@kernel
def _mix(ewma: np.ndarray, i: int, m: int, x: float, alpha: float) -> None:
    old = float(ewma[i, m])
    ewma[i, m] = x if math.isnan(old) else (1 - alpha) * old + alpha * x


@kernel
def feedback_row(
    ewma: np.ndarray,
    steps: np.ndarray,
    run: np.ndarray,
    last_k: np.ndarray,
    i: int,
    m: int,
    a: int,
    d: int,
    cf_codes: np.ndarray,
    cf: np.ndarray,
    j: int,
    cf_mixed: np.ndarray,
    ngram_row: int,
    alpha: float,
    max_k: int,
) -> None:
    """Slot ``i``'s verified (method ``m``, ``a`` accepted of ``d`` drafted) and counterfactual
    (``cf[:, j]``) counts into its averages, and its expected n-gram run at its next position (see
    ``ngram_span``; skipped until a rule recorded a K). ``d`` < 0: the draft's length is not known,
    the K the rule last recorded stands for it."""
    steps[i] += 1
    if m != _OFF:
        _mix(ewma, i, m, float(a), alpha)
    for c in range(len(cf_codes)):
        x = int(cf[c, j])
        if cf_mixed[c] and x != NOT_SCORED:
            _mix(ewma, i, int(cf_codes[c]), float(x), alpha)
    if max_k <= 0:
        return
    ng = m == _NGRAM
    score = a if ng else NOT_SCORED
    # The draft ended at its own length, not at a rejection. Its length, not the K last planned: the
    # plugin plans the next draft before this one's feedback (async), and vLLM's placeholders may
    # have cut it below the K planned.
    cut = ng and a >= (d if d >= 0 else int(last_k[i]))
    if ngram_row >= 0 and not ng:
        x = int(cf[ngram_row, j])
        if x != NOT_SCORED:
            score = x
            cut = x >= max_k
    if score == NOT_SCORED:
        run[i] = math.nan
    elif cut:
        run[i] = float(max_k)
    else:
        # < 0: the position is past the span this draft was scored in (a match here is a fresh span).
        run[i] = float(score - (0 if m == _OFF else a) - 1)


@kernel
def _feedback(
    ewma: np.ndarray,
    steps: np.ndarray,
    run: np.ndarray,
    last_k: np.ndarray,
    s: np.ndarray,
    methods: np.ndarray,
    accepted: np.ndarray,
    drafted: np.ndarray,
    cf_codes: np.ndarray,
    cf: np.ndarray,
    cf_mixed: np.ndarray,
    ngram_row: int,
    alpha: float,
    max_k: int,
) -> None:
    for j in range(len(s)):
        feedback_row(ewma, steps, run, last_k, int(s[j]), int(methods[j]), int(accepted[j]), int(drafted[j]),
                     cf_codes, cf, j, cf_mixed, ngram_row, alpha, max_k)  # fmt: skip


class FastLoop:
    """Per-request state and the rule, as the engine runs them each step.

    Rows are addressed by request id; state lives in numpy arrays indexed by a slot per live request.
    """

    def __init__(self, *, capacity: int = 1024) -> None:
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._ewma = np.zeros((capacity, len(Method)))  # accepted tokens per step, per method
        self._steps = np.zeros(capacity, dtype=np.int64)
        # Expected n-gram run at the request's next position (NaN: unknown), and the K it last drafted.
        self._run = np.full(capacity, np.nan)
        self._k = np.zeros(capacity, dtype=np.int64)
        self._max_k = 0
        #: Counts every slot assigned or released: a caller's cached request -> slot lookup is
        #: current while this has not moved.
        self.slot_changes = 0

    @property
    def slot_of(self) -> Callable[[str, int], int]:
        """``slot_of(request_id, default)``: the request's slot, or ``default`` (nothing is assigned;
        a C-level lookup for the engine's hot path, as ``dict.get``)."""
        return self._slot.get  # type: ignore[return-value]

    def slots(self, request_ids: Sequence[str]) -> np.ndarray:
        """Each request's slot (a new request gets a free one, its state reset)."""
        found = list(
            map(self._slot.get, request_ids, itertools.repeat(-1))
        )  # a C loop: the engine's hot path
        if -1 in found:
            for j, rid in enumerate(request_ids):
                if found[j] < 0:
                    found[j] = self._new_slot(rid)
        return np.array(found, dtype=np.int64)

    def _new_slot(self, rid: str) -> int:
        s = self._slot.get(rid)  # a request listed twice gets one slot
        if s is not None:
            return s
        s = self._free.pop() if self._free else len(self._slot)
        if s >= len(self._steps):
            self._grow()
        self._slot[rid] = s
        self.slot_changes += 1
        self._ewma[s] = np.nan
        self._steps[s] = 0
        self._run[s] = np.nan
        self._k[s] = 0
        return s

    def _grow(self) -> None:
        n = len(self._steps)
        self._ewma = np.vstack([self._ewma, np.zeros((n, len(Method)))])
        self._steps = np.concatenate([self._steps, np.zeros(n, dtype=np.int64)])
        self._run = np.concatenate([self._run, np.full(n, np.nan)])
        self._k = np.concatenate([self._k, np.zeros(n, dtype=np.int64)])

    def release(self, request_id: str) -> int | None:
        """Forget a request; returns the slot it held (None: it held none)."""
        s = self._slot.pop(request_id, None)
        if s is not None:
            self._free.append(s)
            self.slot_changes += 1
        return s

    def plan(
        self,
        directive: Directive,
        request_ids: Sequence[str],
        traffic_classes: Sequence[str],
        batch_size: int,
        max_k: int,
        *,
        slots: np.ndarray | None = None,
        ngram_proposal: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Method codes and K for each request of the next step (``slots``: ``self.slots(request_ids)``
        where the caller has it already).

        ``ngram_proposal``: per request, the n-gram proposer's draft length at its current position
        (0: no match), computed before this step drafts; None where the engine does not report it.
        """
        n = len(request_ids)
        methods, ks = self.class_plan(directive, traffic_classes, batch_size, max_k)
        code, p0, p1, p2 = rule_args(directive)
        if n and code != _NO_RULE:
            self._max_k = max_k
            slots = self.slots(request_ids) if slots is None else slots  # first: it may grow the arrays
            prop = (
                np.full(n, -1, dtype=np.int64)
                if ngram_proposal is None
                else np.asarray(ngram_proposal, dtype=np.int64)
            )
            _plan_rule(
                self._ewma, self._steps, self._run, self._k, slots, methods, ks, code, p0, p1, p2, prop, max_k
            )
        return methods, ks

    @staticmethod
    def class_plan(
        directive: Directive, traffic_classes: Sequence[str], batch_size: int, max_k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Method codes (int8) and K (int32, at most ``max_k``) of each request's class arm at this
        batch size: the plan before the per-request rule."""
        n = len(traffic_classes)
        by_class: dict[str, tuple[int, int]] = {}

        def arm(c: str) -> tuple[int, int]:
            a = directive.arm_for(c, batch_size)
            mk = by_class[c] = (METHOD_CODES[a.method], min(a.k, max_k))
            return mk

        if n and len(set(traffic_classes)) == 1:
            m0, k0 = arm(traffic_classes[0])
            return np.full(n, m0, dtype=np.int8), np.full(n, k0, dtype=np.int32)
        pairs = np.array([by_class.get(c) or arm(c) for c in traffic_classes], dtype=np.int32).reshape(n, 2)
        return pairs[:, 0].astype(np.int8), np.ascontiguousarray(pairs[:, 1])

    def feedback(
        self,
        request_ids: Sequence[str],
        methods: np.ndarray,
        accepted: np.ndarray,
        counterfactual: Mapping[Method, np.ndarray],
        alpha: float = 0.3,
        depth: Mapping[Method, int] | None = None,
        *,
        slots: np.ndarray | None = None,
        drafted: np.ndarray | None = None,
    ) -> None:
        """Fold one step's verified and counterfactual accepted counts into the moving averages.

        Counterfactuals with a limited ``depth`` (e.g. an EAGLE head's first position) are not on the
        same scale as full drafts, so they stay out of the averages the rule compares. ``drafted``:
        each verified draft's length (None: the K the rule last planned stands for it).
        """
        n = len(request_ids)
        if not n:
            return
        codes = np.array([METHOD_CODES[m] for m in counterfactual], dtype=np.int64)
        mixed = np.array([not (depth and m in depth) for m in counterfactual], dtype=np.bool_)
        cf = np.empty((len(codes), n), dtype=np.int64)
        for row, v in enumerate(counterfactual.values()):
            cf[row] = v
        ngram_row = list(counterfactual).index(Method.NGRAM) if Method.NGRAM in counterfactual else -1
        slots = self.slots(request_ids) if slots is None else slots  # first: it may grow the arrays
        _feedback(
            self._ewma,
            self._steps,
            self._run,
            self._k,
            slots,
            np.asarray(methods, dtype=np.int64),
            np.asarray(accepted, dtype=np.int64),
            np.full(n, -1, dtype=np.int64) if drafted is None else np.asarray(drafted, dtype=np.int64),
            codes,
            cf,
            mixed,
            ngram_row,
            float(alpha),
            self._max_k,
        )

    @property
    def capacity(self) -> int:
        return len(self._steps)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The per-slot state for a caller's own kernel (``plan_row`` / ``feedback_row``): the moving
        averages (slot x method code), steps, expected n-gram run, and last K drafted. Arrays are
        replaced when the loop grows (call ``slots`` first)."""
        return self._ewma, self._steps, self._run, self._k

    def note_max_k(self, max_k: int) -> None:
        """A caller that runs ``plan_row`` itself records the engine's max K here (see ``plan``)."""
        self._max_k = max_k

    @property
    def max_k(self) -> int:
        return self._max_k

    def estimate(self, request_id: str, method: Method) -> float:
        s = self._slot.get(request_id)
        return float("nan") if s is None else float(self._ewma[s, METHOD_CODES[method]])


def method_names(codes: np.ndarray) -> list[str]:
    return [METHODS_BY_CODE[int(c)].value for c in codes]
