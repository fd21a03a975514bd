"""The plugin's per-step work as one compiled batch kernel per hook.

``update_from_output`` (``StepKernel.after_update``): for every request that sampled this step, the
n-gram index takes its new tokens, scores its pending draft and drafts anew (``ngram.step_row``),
the report's columns are read off the plan recorded for the verified draft (``rows.columns_row``),
and the fast loop folds in the feedback (``rules.feedback_row``). ``update_draft_token_ids``
(``StepKernel.choose``): per request its class's planned arm, the rule's override
(``rules.plan_row``, which sees the request's n-gram proposal: the length of the draft the index has
for it, computed from tokens the engine already has, so causal), what this engine can draft (``policies.engine_rules.clamp_row``) and which draft it gets
(``control.source_row``). The row functions are the same ones the batch APIs (``FastLoop``,
``Controls``, ``NgramIndex``, ``RequestTable``) loop over, so each behaviour is written once; these
kernels only fuse them, so a step costs one dispatch per hook and no Python object per request
(request ids aside).

What must hold: a step's results equal those of the batch APIs called one after another (tested
against them); a kernel that cannot proceed (a request it has not seen, or no room in the n-gram
index) says so before changing anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from controller.vllm.control import NGRAM_DRAFT, Controls, pick_drafts, source_row
from controller.vllm.ngram import DRAFT_LEN, LEN, NgramIndex, room, step_row
from controller.vllm.rows import PLAN_K, PLAN_METHOD, PLAN_PROPOSAL, RequestTable, columns_row
from policies.arms import METHOD_CODES, Method
from policies.directive import Directive
from policies.engine_rules import clamp_row
from policies.jit import kernel
from policies.observation import NOT_SCORED
from policies.rules import feedback_row, plan_row, rule_args

_OK, _UNSEEN, _NO_ROOM = 0, -1, -2
#: Rows of the after-update output: the report's columns (PROPOSAL: -1 where the index is off).
METHOD, K, DRAFTED, ACCEPTED, CF, CLASS, PROPOSAL = range(7)


@kernel
def _after_update(
    ewma: np.ndarray,
    steps: np.ndarray,
    run: np.ndarray,
    last_k: np.ndarray,
    verifying: np.ndarray,
    cls: np.ndarray,
    live: np.ndarray,
    state: np.ndarray,
    pool: np.ndarray,
    table: np.ndarray,
    meta: np.ndarray,
    drafts: np.ndarray,
    pending: np.ndarray,
    slots: np.ndarray,
    sampled: np.ndarray,
    drafted: np.ndarray,
    finished: np.ndarray,
    tokens: np.ndarray,
    sizes: np.ndarray,
    out: np.ndarray,
    ngram: np.ndarray,
    params: np.ndarray,
    alpha: float,
) -> int:
    """params: scoring (0/1), configured method code, max K, the fast loop's max K, min_n, max_n,
    max_model_len. ``ngram`` is ``[NGRAM code]`` when scoring, else empty."""
    scoring = params[0] != 0
    configured, max_k, fl_max_k = int(params[1]), int(params[2]), int(params[3])
    min_n, max_n, max_model_len = int(params[4]), int(params[5]), int(params[6])
    n = len(slots)
    for j in range(n):
        if not live[slots[j]]:
            return _UNSEEN
    if scoring and not room(state, pool, table, meta, slots, sizes, max_n - min_n + 1):
        return _NO_ROOM
    mixed = np.ones(len(ngram), dtype=np.bool_)
    cf_rows = out[CF : CF + 1]
    ngram_row = 0 if scoring else -1
    at = 0  # row j's tokens: tokens[at : at + sizes[j]]
    for j in range(n):
        s = int(slots[j])
        c = NOT_SCORED
        before = -1
        if scoring:
            before = int(state[s, DRAFT_LEN])  # the proposal before this step's tokens
            c = step_row(state, pool, table, meta, drafts, pending, s, tokens, at, at + int(sizes[j]),
                         not finished[j], min_n, max_n, max_model_len)  # fmt: skip
            at += int(sizes[j])
        d = int(drafted[j])
        m, k, a, c, p = columns_row(verifying, s, int(sampled[j]), d, c, configured, max_k, before)
        out[METHOD, j] = m
        out[K, j] = k
        out[DRAFTED, j] = d
        out[ACCEPTED, j] = a
        out[CF, j] = c
        out[CLASS, j] = cls[s]
        out[PROPOSAL, j] = p
        feedback_row(ewma, steps, run, last_k, s, m, a, ngram, cf_rows, j, mixed, ngram_row, alpha, fl_max_k)
    return _OK


@kernel
def _choose(
    ewma: np.ndarray,
    steps: np.ndarray,
    run: np.ndarray,
    last_k: np.ndarray,
    verifying: np.ndarray,
    cls: np.ndarray,
    class_arm: np.ndarray,
    state: np.ndarray,
    slots: np.ndarray,
    out: np.ndarray,
    params: np.ndarray,
    p0: float,
    p1: float,
    p2: float,
) -> None:
    """params: rule code, max K, configured method code, composite (0/1), scoring (0/1).
    ``class_arm[c]``: class c's planned (method, K). out rows: draft source, its length.

    The rule sees each request's n-gram proposal (its current draft's length in the index, -1 for a
    request the index has not started), and the plan records it for the report."""
    rule, max_k, configured = int(params[0]), int(params[1]), int(params[2])
    composite, scoring = params[3] != 0, params[4] != 0
    for j in range(len(slots)):
        s = int(slots[j])
        c = int(cls[s])
        prop = int(state[s, DRAFT_LEN]) if scoring and int(state[s, LEN]) >= 0 else -1
        m, k = plan_row(ewma, steps, run, last_k, s, int(class_arm[c, 0]), int(class_arm[c, 1]), rule, p0, p1,
                        p2, prop, max_k)  # fmt: skip
        m, k = clamp_row(m, k, configured, composite, max_k)
        verifying[s, PLAN_METHOD] = m
        verifying[s, PLAN_K] = k
        verifying[s, PLAN_PROPOSAL] = prop
        out[0, j], out[1, j] = source_row(m, k, max(prop, 0), composite)


class StepKernel:
    """The hooks' per-step calls into the fused kernels, over the fast loop's slots."""

    def __init__(self, *, controls: Controls, rows: RequestTable, scorer: NgramIndex | None) -> None:
        self.controls = controls
        self.fast = controls.fast
        self.rows = rows
        self.scorer = scorer
        self._ngram = np.array([METHOD_CODES[Method.NGRAM]] if scorer is not None else [], dtype=np.int64)
        self._arms_for: tuple[Directive | None, int, int] = (None, 0, 0)
        self._class_arm = np.zeros((1, 2), dtype=np.int64)
        self._no_state = np.zeros((0, 8), dtype=np.int64)
        self._no_tokens = np.zeros(0, dtype=np.int32)
        empty_rows = np.zeros((0, 1), dtype=np.int32)
        #: The n-gram index's arrays where there is none (the kernel never reads them then).
        self._no_index = (self._no_state, self._no_tokens, self._no_state, np.zeros(4, dtype=np.int64),
                          empty_rows, empty_rows)  # fmt: skip
        self._scratch = np.full((0, 3), -1, dtype=np.int64)  # plans not recorded (``plan``)
        #: _choose's params: rule code, max K (set per call), configured method, composite, scoring.
        self._choose_params = np.array(
            [0, 0, rows.configured, controls.composite, scorer is not None], dtype=np.int64
        )
        sc = scorer
        self._update_params = np.array(
            [sc is not None, rows.configured, rows.max_k, 0, sc.min_n if sc is not None else 1, sc.max_n if sc is not None else 1,
             sc.max_model_len if sc is not None else 0],
            dtype=np.int64,
        )  # fmt: skip

    def _reserve(self) -> None:
        cap = self.fast.capacity
        if self.rows.capacity < cap:
            self.rows.reserve(cap)
        if self.scorer is not None and self.scorer.capacity < cap:
            self.scorer.reserve(cap)

    def after_update(
        self,
        ids: Sequence[str],
        gens: Sequence[Sequence[int]],
        drafted: np.ndarray,
        finished: np.ndarray,
        alpha: float,
        start: Any,
        *,
        sampled: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The step's columns (rows METHOD..PROPOSAL of an int32 array) and slots, for requests ``ids``
        that sampled ``gens`` (``sampled``: their lengths, int64, where the caller has them) after
        drafts of ``drafted`` tokens. ``start(j, slot)`` is called for a request the hooks have not
        seen: it admits the slot (class, n-gram history)."""
        n = len(ids)
        slots = self.fast.slots(ids)
        self._reserve()
        if sampled is None:
            sampled = np.fromiter(map(len, gens), dtype=np.int64, count=n)
        out = np.empty((7, n), dtype=np.int32)
        sc = self.scorer
        params = self._update_params
        params[3] = self.fast.max_k
        sizes = sampled  # tokens each row brings to the index (none for a request just started)
        if sc is not None:
            tokens = np.fromiter(
                itertools.chain.from_iterable(gens), dtype=np.int32, count=sum(map(len, gens))
            )
        else:
            tokens = self._no_tokens
        while True:
            ng = sc.arrays() if sc is not None else self._no_index
            status = _after_update(*self.fast.arrays(), *self.rows.arrays(), *ng, slots, sampled, drafted, finished,
                                   tokens, sizes, out, self._ngram, params, alpha)  # fmt: skip
            if status == _OK:
                return out, slots
            if status == _UNSEEN:
                fresh = self.rows.admit(slots)
                for j in fresh:
                    start(j, int(slots[j]))
                if sc is not None and fresh:  # a new request's tokens are in the history it started with
                    new = list(gens)
                    for j in fresh:
                        new[j] = ()
                    sizes = np.fromiter(map(len, new), dtype=np.int64, count=n)
                    tokens = np.fromiter(
                        itertools.chain.from_iterable(new), dtype=np.int32, count=sum(map(len, new))
                    )
            elif sc is not None:
                sc.make_room()

    def choose(
        self, directive: Directive, req_ids: Sequence[str], drafts: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """Per request the draft to verify next (the configured drafter's, n-gram's or none, cut to
        its K); the plan is recorded for the step that verifies it."""
        slots = self.fast.slots(req_ids)
        self._reserve()
        out = self._plan(directive, slots, len(req_ids), self.rows.arrays()[0])
        sc = self.scorer
        # The n-gram drafts are read only when a row takes one (most steps of most batches do not).
        ngram = sc.drafts(slots)[0].tolist() if sc is not None and NGRAM_DRAFT in out[0].tolist() else drafts
        return pick_drafts(out[0], out[1], drafts, ngram)

    def plan(self, directive: Directive, slots: np.ndarray, batch_size: int) -> np.ndarray:
        """Rows PLAN_METHOD, PLAN_K, PLAN_PROPOSAL (int64): each slot's next draft as ``choose`` plans
        it, not recorded (async scheduling: the plan travels with the scheduler output instead)."""
        self._reserve()
        if len(self._scratch) < self.rows.capacity:
            self._scratch = np.full((self.rows.capacity, 3), -1, dtype=np.int64)
        self._plan(directive, slots, batch_size, self._scratch)
        return self._scratch[slots].T  # type: ignore[no-any-return]

    def _plan(
        self, directive: Directive, slots: np.ndarray, batch_size: int, verifying: np.ndarray
    ) -> np.ndarray:
        """Each slot's plan into ``verifying`` (the rows' table, or a scratch one; ``_reserve`` ran);
        returns each row's draft source and length (see ``_choose``)."""
        max_k = self.controls.engine.max_k
        rule, p0, p1, p2 = rule_args(directive)
        if rule:
            self.fast.note_max_k(max_k)
        out = np.empty((2, len(slots)), dtype=np.int64)
        sc = self.scorer
        params = self._choose_params
        params[0], params[1] = rule, max_k
        _choose(*self.fast.arrays(), verifying, self.rows.arrays()[1], self._arms(directive, batch_size),
                sc.arrays()[0] if sc is not None else self._no_state, slots, out, params, p0, p1, p2)  # fmt: skip
        return out

    def _arms(self, directive: Directive, batch_size: int) -> np.ndarray:
        """Each known class's planned (method code, K) at this batch size (cached)."""
        names = self.rows.class_names
        d, b, n = self._arms_for
        if d is not directive or b != batch_size or n != len(names):
            max_k = self.controls.engine.max_k
            arms = [directive.arm_for(c, batch_size) for c in names]
            self._class_arm = np.array(
                [(METHOD_CODES[a.method], min(a.k, max_k)) for a in arms], dtype=np.int64
            )
            self._arms_for = (directive, batch_size, len(names))
        return self._class_arm
