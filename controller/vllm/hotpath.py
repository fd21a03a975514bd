"""The plugin's per-step work as one compiled batch kernel per hook.

``update_from_output`` (``StepKernel.after_update``): for every request that sampled this step, the
n-gram index takes its new tokens (every row's first), scores its
pending draft and drafts anew (``ngram.append_row`` / ``advance_row``), the report's columns are read
off the plan recorded for the verified draft (``rows.columns_row``; under async scheduling the plan
came with the scheduler output), and the fast loop folds in the feedback (``rules.feedback_row``).
``update_draft_token_ids`` (``StepKernel.choose``) and, under async scheduling,
``_update_after_schedule`` (``StepKernel.place``): per request its class's planned arm, the rule's
override (``rules.plan_row``, which sees the request's n-gram proposal: the length of the draft the
index has for it, computed from tokens the engine already has, so causal), what this engine can draft
(``policies.engine_rules.clamp_row``), and which draft it gets (``control.source_row``) or how many
placeholders. The row functions are the same ones the batch APIs (``FastLoop``, ``Controls``,
``NgramIndex``, ``RequestTable``) loop over, so each behaviour is written once; these kernels only
fuse them, so a step costs one dispatch per hook and no Python object per request (request ids
aside). What a kernel reads per row goes in through one ``np.fromiter`` over C-level maps: on the
engine's thread every numpy call and every Python-level row costs more than the kernel's work.

What must hold: a step's results equal those of the batch APIs called one after another (tested
against them); a kernel that cannot proceed (a request it has not seen, or no room in the n-gram
index) says so before changing anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from controller.vllm.control import NGRAM_DRAFT, ClassArms, Controls, pick_drafts, source_row
from controller.vllm.ngram import DRAFT_LEN, LEN, NgramIndex, advance_row, append_row, prefetch_row, room
from controller.vllm.rows import PLAN_K, PLAN_METHOD, PLAN_PROPOSAL, RequestTable, columns_row
from policies.arms import METHOD_CODES, Method
from policies.directive import Directive
from policies.engine_rules import clamp_row, drafter_k_row
from policies.jit import kernel
from policies.observation import NOT_SCORED
from policies.rules import feedback_row, plan_row, rule_args

_UNSEEN, _NO_ROOM = -1, -2
_OFF = METHOD_CODES[Method.OFF]
_NGRAM = METHOD_CODES[Method.NGRAM]
_NO_PLAN = (-1, -1, -1)
#: Rows of the after-update output: the report's columns (PROPOSAL: -1 where the index is off), in
#: this order (the hooks unpack them so).
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
    buf: np.ndarray,
    plans: np.ndarray,
    out: np.ndarray,
    finished: np.ndarray,
    ngram: np.ndarray,
    params: np.ndarray,
    alpha: float,
) -> int:
    """The step's rows: ``slots[j]`` (-1: none yet), and from one int64 buffer (``StepKernel.after_update``
    lays it out) per row the tokens sampled, the tokens drafted; then (where ``params[9]``) whether
    it finished (else none did); then (where ``params[8]``) the tokens each row brings to the index
    (else all it sampled); then the tokens themselves, row after row. ``plans[j]`` (where
    ``params[7]``): the plan row j's draft was made with (-1: none recorded). Writes the report's
    columns into ``out`` and the finished flags into ``finished``; returns how many rows finished, or
    _UNSEEN / _NO_ROOM having changed nothing.

    params: scoring (0/1), configured method code, max K, the fast loop's max K, min_n, max_n,
    max_model_len, plans given (0/1), index sizes given (0/1), finished flags given (0/1). ``ngram`` is
    ``[NGRAM code]`` when scoring, else empty."""
    scoring = params[0] != 0
    configured, max_k, fl_max_k = int(params[1]), int(params[2]), int(params[3])
    min_n, max_n, max_model_len = int(params[4]), int(params[5]), int(params[6])
    n = len(finished)
    sampled, drafted = buf[:n], buf[n : 2 * n]
    at = 2 * n
    done = finished  # no row finished unless flags are given (written below, read before)
    finished[:] = False
    if params[9] != 0:
        done = buf[at : at + n] != 0
        at += n
    sizes = sampled  # what each row brings to the index: what it sampled, unless given
    if params[8] != 0:
        sizes = buf[at : at + n]
        at += n
    tokens = buf[at:]
    given = params[7] != 0
    for j in range(n):  # (async scheduling admits a request, its class set, before its index starts)
        if slots[j] < 0 or not live[slots[j]] or (scoring and state[slots[j], LEN] < 0):
            return _UNSEEN
    if scoring and not room(state, pool, table, meta, slots, sizes, max_n - min_n + 1):
        return _NO_ROOM
    mixed = np.ones(len(ngram), dtype=np.bool_)
    cf_rows = out[CF : CF + 1]
    ngram_row = 0 if scoring else -1
    if scoring:  # every row's tokens first (room was made for all of them above)
        at = 0  # row j's tokens: tokens[at : at + sizes[j]]
        for j in range(n):
            append_row(state, pool, meta, int(slots[j]), tokens, at, at + int(sizes[j]))
            at += int(sizes[j])
        for j in range(n):
            prefetch_row(state, pool, table, int(slots[j]), min_n, max_n)
    ended = 0
    for j in range(n):
        s = int(slots[j])
        fin = bool(done[j])
        finished[j] = fin
        ended += fin
        if given and plans[j, 0] >= 0:  # async: the plan travelled with the scheduler output
            for c in range(3):
                verifying[s, c] = plans[j, c]
        c = NOT_SCORED
        before = -1
        if scoring:
            before = int(state[s, DRAFT_LEN])  # the proposal before this step's tokens
            c = advance_row(state, pool, table, meta, drafts, pending, s, int(sizes[j]) > 0, not fin, min_n, max_n,
                            max_model_len)  # fmt: skip
        # (never above max K: the sidecar refuses a whole batch over one row whose K exceeds it)
        d = min(int(drafted[j]), max_k)
        m, k, a, c, p = columns_row(verifying, s, int(sampled[j]), d, c, configured, max_k, before)
        out[METHOD, j] = m
        out[K, j] = k
        out[DRAFTED, j] = d
        out[ACCEPTED, j] = a
        out[CF, j] = c
        out[CLASS, j] = cls[s]
        out[PROPOSAL, j] = p
        feedback_row(
            ewma, steps, run, last_k, s, m, a, d, ngram, cf_rows, j, mixed, ngram_row, alpha, fl_max_k
        )
    return ended


@kernel
def _plan_one(
    ewma: np.ndarray,
    steps: np.ndarray,
    run: np.ndarray,
    last_k: np.ndarray,
    cls: np.ndarray,
    class_arm: np.ndarray,
    state: np.ndarray,
    s: int,
    params: np.ndarray,
    p0: float,
    p1: float,
    p2: float,
) -> tuple[int, int, int]:
    """Slot ``s``'s next draft: (method, K, the n-gram proposal it was planned with). params: rule
    code, max K, configured method code, composite (0/1), scoring (0/1). ``class_arm[c]``: class c's
    planned (method, K). The rule sees the request's n-gram proposal (its current draft's length in
    the index, -1 for a request the index has not started)."""
    rule, max_k, configured = int(params[0]), int(params[1]), int(params[2])
    composite, scoring = params[3] != 0, params[4] != 0
    c = int(cls[s])
    prop = int(state[s, DRAFT_LEN]) if scoring and int(state[s, LEN]) >= 0 else -1
    m, k = plan_row(ewma, steps, run, last_k, s, int(class_arm[c, 0]), int(class_arm[c, 1]), rule, p0, p1, p2,
                    prop, max_k)  # fmt: skip
    m, k = clamp_row(m, k, configured, composite, max_k)
    return m, k, prop


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
    drafts: np.ndarray,
    slots: np.ndarray,
    out: np.ndarray,
    ngram_out: np.ndarray,
    params: np.ndarray,
    p0: float,
    p1: float,
    p2: float,
) -> tuple[int, int]:
    """Synchronous scheduling: each slot's plan (``_plan_one``) recorded in ``verifying`` for the
    report, the configured drafter's K at most the length of its drafts (``params[5]``: vLLM ran it at
    the step's K); out rows: draft source, its length; a row that takes the n-gram draft finds it in
    ``ngram_out`` (its first tokens). Returns how many rows take it, and ``_drafter_k_guess`` of these
    rows with these plans pending (what the next schedule guesses, if it schedules no other rows)."""
    max_k, composite = int(params[1]), params[3] != 0
    configured, drafted = int(params[2]), int(params[5])
    taken = 0
    top = 0
    for j in range(len(slots)):
        s = int(slots[j])
        m, k, prop = _plan_one(ewma, steps, run, last_k, cls, class_arm, state, s, params, p0, p1, p2)
        if m == configured and k > drafted:  # no longer than the configured drafter's drafts
            k = drafted
            last_k[s] = k
        verifying[s, PLAN_METHOD] = m
        verifying[s, PLAN_K] = k
        verifying[s, PLAN_PROPOSAL] = prop
        c = int(cls[s])
        top = max(
            top, drafter_k_row(int(class_arm[c, 0]), int(class_arm[c, 1]), m, configured, composite, max_k)
        )
        src, length = source_row(m, k, max(prop, 0), composite)
        out[0, j] = src
        out[1, j] = length
        if src == NGRAM_DRAFT and j < ngram_out.shape[0]:
            for t in range(length):
                ngram_out[j, t] = drafts[s, t]
            taken += 1
    return taken, top


@kernel
def _drafter_k_guess(
    verifying: np.ndarray, cls: np.ndarray, live: np.ndarray, class_arm: np.ndarray, slots: np.ndarray,
    params: np.ndarray,
) -> int:  # fmt: skip
    """Synchronous scheduling: the largest K the configured drafter's rows of this step are likely to
    plan next (0: none), guessed before the step runs (its plans are made after it, in
    ``update_draft_token_ids``): ``drafter_k_row`` of each row's class arm and pending plan. A request
    not admitted yet (its class unknown here) counts with the largest arm of any class. params:
    ``_plan_one``'s."""
    max_k, configured, composite = int(params[1]), int(params[2]), params[3] != 0
    top = 0
    unknown = False
    for j in range(len(slots)):
        s = int(slots[j])
        if s < 0 or s >= len(cls) or live[s] == 0:
            unknown = True
            continue
        c = int(cls[s])
        k = drafter_k_row(int(class_arm[c, 0]), int(class_arm[c, 1]), int(verifying[s, PLAN_METHOD]), configured,
                          composite, max_k)  # fmt: skip
        top = max(top, k)
    if unknown:
        for c in range(class_arm.shape[0]):
            top = max(top, drafter_k_row(int(class_arm[c, 0]), int(class_arm[c, 1]), -1, configured, composite,
                                         max_k))  # fmt: skip
    return top


@kernel
def _place(
    ewma: np.ndarray,
    steps: np.ndarray,
    run: np.ndarray,
    last_k: np.ndarray,
    cls: np.ndarray,
    class_arm: np.ndarray,
    state: np.ndarray,
    placed: np.ndarray,
    slots: np.ndarray,
    rooms: np.ndarray,
    vslots: np.ndarray,
    out: np.ndarray,
    taken: np.ndarray,
    params: np.ndarray,
    p0: float,
    p1: float,
    p2: float,
) -> int:
    """Async scheduling: first the plans of the drafts verified now (slots ``vslots``, -1: none) are
    taken out of ``placed`` into ``taken`` (-1 rows: none recorded); then each row's plan
    (``_plan_one``, slot ``slots[j]``) cut to the ``rooms[j]`` placeholders vLLM gave it (``rooms``
    of one element: every row's) is recorded in ``placed`` (method off where K is 0, K, the n-gram
    proposal planned with). out rows: K, whether n-gram. Returns _UNSEEN (nothing changed) when a row
    has no slot."""
    n = len(slots)
    for j in range(n):
        if slots[j] < 0:
            return _UNSEEN
    for i in range(len(vslots)):
        s = int(vslots[i])
        for c in range(3):
            taken[i, c] = placed[s, c] if s >= 0 else -1
            if s >= 0:
                placed[s, c] = -1
    one_room = len(rooms) == 1
    for j in range(n):
        s = int(slots[j])
        m, k, prop = _plan_one(ewma, steps, run, last_k, cls, class_arm, state, s, params, p0, p1, p2)
        k = min(k, int(rooms[0] if one_room else rooms[j]))
        m = m if k > 0 else _OFF
        placed[s, PLAN_METHOD] = m
        placed[s, PLAN_K] = k
        placed[s, PLAN_PROPOSAL] = prop
        out[0, j] = k
        out[1, j] = m == _NGRAM
    return 0


def _aligned(plans: tuple[list[str], np.ndarray], ids: Sequence[str]) -> np.ndarray:
    """The travelling plans (requests, one row each) as one row per request of ``ids`` (-1: none)."""
    by_id = dict(zip(plans[0], map(tuple, plans[1].tolist()), strict=True))
    rows = np.fromiter(
        itertools.chain.from_iterable(map(by_id.get, ids, itertools.repeat(_NO_PLAN))),
        dtype=np.int64,
        count=3 * len(ids),
    )
    return rows.reshape(len(ids), 3)


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
        #: The directive's class arms per stretch of batch sizes (``ClassArms``), for ``_arms``.
        self._class_arms = ClassArms(controls.safe, controls.engine.max_k)
        self._no_state = np.zeros((0, 8), dtype=np.int64)
        self._no_tokens = np.zeros(0, dtype=np.int32)
        self._no_drafts = np.zeros((0, 1), dtype=np.int32)
        empty_rows = np.zeros((0, 1), dtype=np.int32)
        #: The n-gram index's arrays where there is none (the kernel never reads them then).
        self._no_index = (self._no_state, self._no_tokens, self._no_state, np.zeros(4, dtype=np.int64),
                          empty_rows, empty_rows)  # fmt: skip
        self._rule_for: tuple[Directive | None, tuple[int, float, float, float]] = (None, (0, 0.0, 0.0, 0.0))
        self._fast_max_k = 0  # the fast loop's max K as last put in _update_params
        self._no_plans = np.zeros((0, 3), dtype=np.int64)
        self._room = np.zeros(1, dtype=np.int64)
        #: The last ``choose``'s directive, batch size and ``_drafter_k_guess`` (-1: none).
        self._chosen: tuple[Directive | None, int, int] = (None, 0, -1)
        #: ``slots_of``'s last answer: the ids, the fast loop's slot changes then, the slots.
        self._ids: list[str] = []
        self._ids_changes = -1
        self._ids_slots = np.zeros(0, dtype=np.int64)
        #: _plan_one's params: rule code (set per call), max K, configured method, composite, scoring;
        #: and ``_choose``'s: the length of the configured drafter's drafts (set per call).
        self._choose_params = np.array(
            [
                0,
                controls.engine.max_k,
                rows.configured,
                controls.composite,
                scorer is not None,
                controls.engine.max_k,
            ],
            dtype=np.int64,
        )
        sc = scorer
        self._update_params = np.array(
            [sc is not None, rows.configured, rows.max_k, 0, sc.min_n if sc is not None else 1, sc.max_n if sc is not None else 1,
             sc.max_model_len if sc is not None else 0, 0, 0, 0],
            dtype=np.int64,
        )  # fmt: skip

    def _reserve(self) -> None:
        cap = self.fast.capacity
        if self.rows.capacity < cap:
            self.rows.reserve(cap)
        if self.scorer is not None and self.scorer.capacity < cap:
            self.scorer.reserve(cap)

    def slots_of(self, ids: list[str]) -> np.ndarray:
        """The fast loop's slot of each request (-1: none yet; nothing is assigned). The last answer
        is kept and given again while the same ids come in the same order and no slot was assigned or
        released since: in steady decoding the batch is the same from one step to the next."""
        changes = self.fast.slot_changes
        if ids != self._ids or changes != self._ids_changes:
            self._ids_slots = np.fromiter(
                map(self.fast.slot_of, ids, itertools.repeat(-1)), dtype=np.int64, count=len(ids)
            )
            self._ids, self._ids_changes = ids, changes
        return self._ids_slots

    def after_update(
        self,
        ids: list[str],
        gens: Sequence[Sequence[int]],
        spec: Mapping[str, Sequence[int]],
        is_finished: Callable[[str], bool] | None,
        alpha: float,
        start: Callable[[int, int], None],
        plans: tuple[list[str], np.ndarray] | None = None,
        indexed: Sequence[int] = (),
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The step's columns (rows METHOD..PROPOSAL of an int32 array), finished flags and how many
        rows finished, for requests ``ids`` that sampled ``gens`` after verifying the drafts ``spec``
        names (none where absent); ``is_finished`` None: none finished. ``start(j, slot)`` is called
        for a request the hooks have not seen, or whose n-gram history has not started (``place``
        admitted it): it admits the slot (class, n-gram history). ``plans``:
        the plans the drafts were made with, where they travelled with the scheduler output (async
        scheduling; ``place``'s requests and plans); otherwise the plan recorded by ``choose``.
        ``indexed``: rows whose n-gram history the caller restarted with this step's tokens in it (a
        resumed request), so they bring none to the index.

        Everything else the kernel reads per row is laid out in one int64 buffer by one
        ``np.fromiter`` over C-level maps (each numpy call, and each Python-level row, costs more
        than the kernel's work)."""
        n = len(ids)
        sc = self.scorer
        params = self._update_params
        if self.fast.max_k != self._fast_max_k:  # (a numpy store costs more than the comparison)
            params[3] = self._fast_max_k = self.fast.max_k
        params[7] = plans is not None
        params[9] = is_finished is not None
        out = np.empty((7, n), dtype=np.int32)
        finished = np.empty(n, dtype=np.bool_)
        aligned = self._no_plans
        if plans is not None:
            aligned = plans[1] if plans[0] == ids else _aligned(plans, ids)
        index_gens: list[Sequence[int]] | None = None  # the tokens each row brings, where not all
        if indexed and sc is not None:
            index_gens = list(gens)
            for j in indexed:
                index_gens[j] = ()
            params[8] = 1
        while True:
            slots = self.slots_of(ids)
            parts: list[Iterable[int]] = [map(len, gens), map(len, map(spec.get, ids, itertools.repeat(())))]
            size = 2 * n
            if is_finished is not None:
                parts.append(map(is_finished, ids))
                size += n
            if index_gens is not None:
                parts.append(map(len, index_gens))
                size += n
            if sc is not None:
                toks = gens if index_gens is None else index_gens
                parts.append(itertools.chain.from_iterable(toks))
                size += sum(map(len, toks))
            buf = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=size)
            ng = sc.arrays() if sc is not None else self._no_index
            status = _after_update(*self.fast.arrays(), *self.rows.arrays(), *ng, slots, buf, aligned, out, finished,
                                   self._ngram, params, alpha)  # fmt: skip
            if status >= 0:
                params[8] = 0
                return out, finished, status
            if status == _UNSEEN:
                new_slots = self.fast.slots(ids)  # new requests get their slots here
                self._reserve()
                fresh = self.rows.admit(new_slots)
                if sc is not None:  # admitted by ``place`` (its class known) but its index not started
                    fresh = sorted({*fresh, *(j for j in range(n) if not sc.live(int(new_slots[j])))})
                for j in fresh:
                    start(j, int(new_slots[j]))
                if fresh and sc is not None:  # a new request's tokens are in the history it started with
                    index_gens = list(gens) if index_gens is None else index_gens
                    for j in fresh:
                        index_gens[j] = ()
                    params[8] = 1
            elif sc is not None:
                sc.make_room()

    def choose(
        self,
        directive: Directive,
        req_ids: Sequence[str],
        drafts: Sequence[Sequence[int]],
        unplanned: Sequence[int] = (),
    ) -> list[list[int]]:
        """Per request the draft to verify next (the configured drafter's, n-gram's or none, cut to
        its K, the configured drafter's K at most its drafts' length); the plan is recorded for the
        step that verifies it, except for the rows ``unplanned`` (whose draft vLLM drops: no step
        verifies it)."""
        slots = self.fast.slots(req_ids)
        self._reserve()
        n = len(req_ids)
        p0, p1, p2 = self._rule(directive)
        out = np.empty((2, n), dtype=np.int64)
        sc = self.scorer
        ngram = (
            np.empty((n, self.controls.engine.max_k), dtype=np.int32) if sc is not None else self._no_drafts
        )
        state, drafts_ix = (
            (sc.arrays()[0], sc.arrays()[4]) if sc is not None else (self._no_state, self._no_drafts)
        )
        self._choose_params[5] = max(map(len, drafts), default=0)
        taken, top = _choose(*self.fast.arrays(), self.rows.arrays()[0], self.rows.arrays()[1],
                             self._arms(directive, n), state, drafts_ix, slots, out, ngram, self._choose_params, p0,
                             p1, p2)  # fmt: skip
        # (a row left unplanned has no plan pending: the schedule guesses afresh)
        self._chosen = (directive, n, -1 if unplanned else top)
        if unplanned:
            self.rows.arrays()[0][slots[list(unplanned)]] = -1
        # The n-gram drafts are read only when a row takes one (most steps of most batches do not).
        return pick_drafts(out[0], out[1], drafts, ngram.tolist() if taken else drafts)

    def place(
        self,
        directive: Directive,
        req_ids: list[str],
        rooms: list[int],
        batch_size: int,
        verifying: Iterable[str],
        admit: Callable[[int, int], None] | None = None,
    ) -> tuple[list[int], list[int], tuple[list[str], np.ndarray]]:
        """Async scheduling: per request its next draft's K (at most its ``rooms`` placeholders: one
        per request, or one for every request) and
        whether it is n-gram's (0/1), as two lists; the plan (method code, off where K is 0; K; the
        n-gram proposal) is recorded per slot until a step verifies the draft. The plans of the drafts
        the ``verifying`` requests verify now are taken out and returned (for ``after_update``, with
        the scheduler output that carries them): the requests, and one plan row each (-1: none).
        ``admit(j, slot)`` sets the class of a request seen for the first time before it is planned
        (vLLM gives a request placeholders in the schedule its prefill completes, before any update
        of it): its first drafts follow its own class's arm, not the default's."""
        n = len(req_ids)
        vids = list(verifying)
        p0, p1, p2 = self._rule(directive)
        room = self._room
        if len(rooms) == 1 or (n and rooms.count(rooms[0]) == n):  # every row the same placeholders
            room[0] = rooms[0]
            room_arr = room
        else:
            room_arr = np.array(rooms, dtype=np.int64)
        out = np.empty((2, n), dtype=np.int64)
        taken = np.empty((len(vids), 3), dtype=np.int64)
        while True:
            arms = self._arms(directive, batch_size)  # (cached; ``admit`` may add a class)
            slots = self.slots_of(req_ids)
            vslots = slots if vids == req_ids else self.fast_slots_of(vids)
            status = _place(*self.fast.arrays(), self.rows.arrays()[1], arms,
                            self.scorer.arrays()[0] if self.scorer is not None else self._no_state, self.rows.placed,
                            slots, room_arr, vslots, out, taken, self._choose_params, p0, p1, p2)  # fmt: skip
            if status == 0:
                ks, on_ngram = out.tolist()
                return ks, on_ngram, (vids, taken)
            new = self.fast.slots(req_ids)  # new requests get their slots
            self._reserve()
            if admit is not None:
                for j in self.rows.admit(new):
                    admit(j, int(new[j]))

    def chosen_drafter_k(self, directive: Directive, batch_size: int) -> int:
        """``drafter_k_guess`` of the rows the last ``choose`` planned, with the plans it made: the
        next schedule's guess when it schedules those rows or some of them (a row that left can only
        lower the guess, so this is never below it) and ``directive`` and the batch size (its arms) are
        the same; -1 where that is not known."""
        d, n, top = self._chosen
        return top if d is directive and n == batch_size else -1

    def drafter_k_guess(self, directive: Directive, req_ids: list[str], batch_size: int) -> int:
        """Synchronous scheduling: the largest K the configured drafter's rows are likely to plan for
        the drafts made after this step (``_drafter_k_guess``; 0: none)."""
        verifying, cls, live = self.rows.arrays()
        return int(_drafter_k_guess(verifying, cls, live, self._arms(directive, batch_size),
                                    self.slots_of(req_ids), self._choose_params))  # fmt: skip

    def fast_slots_of(self, ids: Sequence[str]) -> np.ndarray:
        """The fast loop's slot of each request (-1: none), not kept."""
        return np.fromiter(map(self.fast.slot_of, ids, itertools.repeat(-1)), dtype=np.int64, count=len(ids))

    def _rule(self, directive: Directive) -> tuple[float, float, float]:
        """The directive's rule parameters (``rule_args``, cached per directive); its code goes into
        the kernels' params."""
        if self._rule_for[0] is not directive:
            self._rule_for = (directive, rule_args(directive))
            rule = self._rule_for[1][0]
            if rule:
                self.fast.note_max_k(self.controls.engine.max_k)
            self._choose_params[0] = rule
        return self._rule_for[1][1:]  # type: ignore[return-value]

    def _arms(self, directive: Directive, batch_size: int) -> np.ndarray:
        """Each known class's planned (method code, K) at this batch size (cached)."""
        names = self.rows.class_names
        d, b, n = self._arms_for
        if d is not directive or b != batch_size or n != len(names):
            if self._class_arms.directive is not directive:
                self._class_arms = ClassArms(directive, self.controls.engine.max_k)
            self._class_arm = self._class_arms.arms(names, batch_size)
            self._arms_for = (directive, batch_size, len(names))
        return self._class_arm
