"""What the engine applies between steps: the directive in force (or the safe default), the
scheduler's batch-size -> K table, and the per-request plan (the fast loop), vectorised over the batch.

Pure: the vLLM hooks feed it request ids, classes and drafts, and copy its answers into the scheduler.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from policies.arms import METHOD_CODES, METHODS_BY_CODE, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import Directive, PlanEntry
from policies.engine import EngineInfo, Granularity
from policies.engine_rules import clamp_plan, clamp_row, safe_default_directive, startup_table_directive
from policies.jit import kernel
from policies.rules import FastLoop

_OFF = METHOD_CODES[Method.OFF]
_NGRAM = METHOD_CODES[Method.NGRAM]


def engine_arms(
    method: Method, max_k: int, *, composite: bool, table_ks: Collection[int] | None = None
) -> tuple[Arm, ...]:
    """The arms an engine configured with ``method`` can apply live. Without the composite drafter
    only the K values of the engine's start-up table (``table_ks``; None: every K) can be played."""
    ks = list(range(1, max_k + 1))
    if table_ks is not None and not composite:
        ks = sorted(k for k in set(table_ks) if 1 <= k <= max_k)
    arms = [Arm(method, k) for k in ks]
    if composite and method is not Method.NGRAM:
        arms += [Arm(Method.NGRAM, k) for k in range(1, max_k + 1)]
    return (*arms, Arm(Method.OFF, 0))


def engine_info(
    *,
    engine_id: str,
    model: str,
    method: Method,
    max_k: int,
    max_batch_size: int,
    composite: bool,
    table_ks: Collection[int] | None = None,
    p_eagle_depths: bool = False,
) -> EngineInfo:
    """REQUEST_METHOD with n-gram counterfactuals when the composite drafter is active; otherwise
    BATCH_STEP with the configured method's arms (the scheduler's K table is all it can change).
    ``p_eagle_depths``: the P-EAGLE depth fix is in (``peagle.py``), so the table may hold any K."""
    return EngineInfo(
        engine_id=engine_id,
        model=model,
        max_k=max_k,
        arms=engine_arms(method, max_k, composite=composite, table_ks=table_ks),
        granularity=Granularity.REQUEST_METHOD if composite else Granularity.BATCH_STEP,
        max_batch_size=max_batch_size,
        counterfactual_methods=(Method.NGRAM,) if composite and method is not Method.NGRAM else (),
        # Aligned at every K: either the depth fix keeps vLLM's reshape at 0 < K < max aligned
        # (llm_base_proposer.py:629-635), or the composite drafter has P-EAGLE draft max_k (the table
        # stays in {0, max}) and cuts each request's draft.
        p_eagle_partial_k_safe=composite or p_eagle_depths,
    )


@dataclass(frozen=True, slots=True)
class Plan:
    method: np.ndarray  # int8 codes, one per request
    k: np.ndarray  # int32


class Controls:
    """Turns the directive in force into the scheduler's table and per-request plans."""

    def __init__(
        self,
        *,
        engine: EngineInfo,
        method: Method,
        safe_default: Arm,
        composite: bool,
        capacity: int = 1024,
        table_ks: Collection[int] | None = None,
        p_eagle_depths: bool = False,
        placeholders: bool = False,
        safe_table: Sequence[int] | None = None,
    ) -> None:
        self.engine = engine
        self.method = method
        self.composite = composite
        #: Async scheduling with the composite drafter: the table is each request's placeholder room
        #: (``Directive.width_for_batch``: max K where the rule drafts n-gram past the plan), which the
        #: plugin shortens per request; the configured drafter runs at its own rows' K (``drafter_k``).
        self.placeholders = placeholders
        #: P-EAGLE's table may hold 0 < K < max (the depth fix is in); otherwise only 0 or max.
        self.p_eagle_depths = p_eagle_depths
        #: What the engine runs on by itself (version 0): ``safe_table`` (vLLM's start-up K per batch
        #: size, ``startup_table_directive``) where given, else ``safe_default`` everywhere.
        self.safe = (
            startup_table_directive(safe_table, method, max_k=engine.max_k)
            if safe_table
            else safe_default_directive(safe_default, max_k=engine.max_k)
        )
        self.fast = FastLoop(capacity=capacity)
        #: The directive the cached table was built from (by identity: a sidecar that restarted
        #: without its state numbers from 1 again, so version and policy name can repeat).
        self._table_of: Directive | None = None
        self._table: list[int] = []
        #: The K values vLLM prepared at start-up (num_speculative_tokens_per_batch_size); a table
        #: K between them is raised to the next one (the composite drafter cuts drafts per request).
        self._table_ks = sorted({k for k in table_ks if 0 < k <= engine.max_k}) if table_ks else []
        #: Async scheduling (``EngineHooks.size_placeholders``): per K planned for the step's rows on the
        #: configured drafter (index 0..max_k), the K that drafter runs at (``drafter_k``).
        self.drafter_ks = [self.drafter_k(k) for k in range(engine.max_k + 1)]

    @property
    def safe_arm(self) -> Arm:
        """The arm the safe default runs as on this engine: the configured one, or what this engine
        makes of it (``clamp_row``: a method it cannot draft becomes its own, K at most its max)."""
        arm = self.safe.plan[0].arm
        m, k = clamp_row(METHOD_CODES[arm.method], arm.k, METHOD_CODES[self.method], self.composite,
                         self.engine.max_k)  # fmt: skip
        return Arm(METHODS_BY_CODE[m], k)

    def in_force(self, fresh: Directive | None) -> Directive:
        return self.safe if fresh is None else fresh

    def k_table(self, d: Directive) -> list[int]:
        """vLLM's ``dynamic_sd_lookup``: index = batch size (0..max_batch_size), clamped to max_k.

        Without the depth fix P-EAGLE drafts either max_k or nothing (vLLM misaligns drafts in
        between); per-request K is then done by truncation in the composite drafter.
        """
        if d is self._table_of:  # the usual step: the directive in force is the one object
            return self._table
        n, mk = self.engine.max_batch_size, self.engine.max_k
        per_batch = d.width_for_batch if self.placeholders else d.k_for_batch
        # Once per stretch of batch sizes on which no range starts or ends (the K is the same across
        # it), not once per batch size: each lookup scans the whole table.
        table = [mk]
        for lo, hi in itertools.pairwise([1, *(e for e in range_edges(d) if 1 < e <= n), n + 1]):
            table += [per_batch(lo, mk)] * (hi - lo)
        if self.method is Method.P_EAGLE and not self.p_eagle_depths:
            table = [mk if k > 0 else 0 for k in table]
        elif self._table_ks:
            top = self._table_ks[-1]
            table = [k if k <= 0 else next((t for t in self._table_ks if t >= k), top) for k in table]
        self._table_of, self._table = d, table
        return table

    def drafter_k(self, k: int) -> int:
        """The K the configured drafter (EAGLE-3, P-EAGLE) runs at when ``k`` is the largest K planned
        for its rows in a step: at least 1 (its first forward keeps its hidden states current, whatever
        is verified), raised to the smallest K vLLM prepared at start-up (it set up dynamic K, CUDA-graph
        sizes included, for those only: the conservative choice on a GPU; the largest where none is as
        large), and max_k for P-EAGLE without the depth fix (it drafts max_k or nothing). The caller caps
        it at the step's table K."""
        k = max(1, k)
        if self.method is Method.P_EAGLE and not self.p_eagle_depths:
            return self.engine.max_k
        if self._table_ks:
            return next((t for t in self._table_ks if t >= k), self._table_ks[-1])
        return k

    def plan(
        self,
        d: Directive,
        request_ids: Sequence[str],
        classes: Sequence[str],
        batch_size: int,
        *,
        slots: np.ndarray | None = None,
        ngram_proposal: np.ndarray | None = None,
    ) -> Plan:
        """The fast loop's choice for each request's next draft (``slots``: the fast loop's, if known;
        ``ngram_proposal``: each request's n-gram proposal, -1 where unknown, None: not reported)."""
        methods, ks = self.fast.plan(
            d, request_ids, classes, batch_size, self.engine.max_k, slots=slots, ngram_proposal=ngram_proposal
        )
        methods, ks = clamp_plan(
            methods, ks, configured=self.method, composite=self.composite, max_k=self.engine.max_k
        )
        return Plan(methods, ks)

    def choose_drafts(
        self,
        plan: Plan,
        configured: Sequence[Sequence[int]],
        ngram: Sequence[Sequence[int]],
        ngram_len: np.ndarray,
    ) -> list[list[int]]:
        """Per request: the configured drafter's draft, the n-gram draft (``ngram[j][:ngram_len[j]]``)
        or nothing, cut to its K."""
        src, n = _sources(plan.method, plan.k, np.asarray(ngram_len, dtype=np.int64), self.composite)
        return pick_drafts(src, n, configured, ngram)


def describe_safe_default(d: Directive) -> str:
    """The safe default in a log line: ``eagle3:4`` (one arm everywhere) or the start-up table's K per
    batch range, ``eagle3 K 1-4:5, 5-8:4, 65+:1``."""
    if len(d.k_table) == 1 and len(d.plan) == 1:
        return str(d.plan[0].arm)
    ranges = ", ".join(f"{r.bs_min}{f'-{r.bs_max}' if r.bs_max else '+'}:{r.k}" for r in d.k_table)
    return f"{d.method.value} K {ranges} (vLLM's start-up table)"


def range_edges(d: Directive) -> list[int]:
    """The batch sizes at which a range of ``d`` (its K table's or its plan's) starts or ends, sorted,
    1 first: between two of them every lookup of ``d`` by batch size gives one answer."""
    edges = {1}
    for lo, hi in itertools.chain(
        ((r.bs_min, r.bs_max) for r in d.k_table), ((e.bs_min, e.bs_max) for e in d.plan)
    ):
        edges.add(lo)
        if hi:
            edges.add(hi + 1)
    return sorted(edges)


class ClassArms:
    """Each traffic class's planned arm under one directive (``Directive.arm_for``), as the step's
    kernels read them: (method code, K at most ``max_k``) per class, index = the class's number.

    ``arm_for`` scans the whole plan, and the hooks need every known class's arm whenever the batch
    size changes: for 256 classes under a sidecar's plan for them (6 buckets x 257 entries) that was
    about 19 ms of the engine's step at every change of the batch size, and seconds for a plan of
    thousands of entries. Here each class looks at a directive holding only its own entries and "*"'s
    (the same answer: ``arm_for`` takes the class's first covering entry, else the first covering
    "*"), and the answers are kept per stretch of batch sizes between ``range_edges``."""

    #: Stretches kept (a batch size picks one; beyond this many all are dropped and made again).
    KEEP = 64

    def __init__(self, directive: Directive, max_k: int) -> None:
        self.directive = directive
        self.max_k = max_k
        self._edges = range_edges(directive)
        own: dict[str, list[PlanEntry]] = {}
        star: list[PlanEntry] = []
        for e in directive.plan:
            (star if e.traffic_class == ANY_CLASS else own.setdefault(e.traffic_class, [])).append(e)
        self._star = dataclasses.replace(directive, plan=tuple(star))
        self._own = own
        self._by_class: dict[str, Directive] = {}
        self._kept: dict[int, np.ndarray] = {}

    def for_class(self, name: str) -> Directive:
        """``directive`` as far as class ``name`` reads it (its own plan entries and "*"'s)."""
        d = self._by_class.get(name)
        if d is None:
            own = self._own.get(name)
            d = self._by_class[name] = (
                dataclasses.replace(self._star, plan=(*own, *self._star.plan)) if own else self._star
            )
        return d

    def arms(self, names: Sequence[str], batch_size: int) -> np.ndarray:
        """Class ``names[c]``'s (method code, K) at ``batch_size``, row c (int64)."""
        stretch = bisect.bisect_right(self._edges, batch_size)
        kept = self._kept.get(stretch)
        if kept is not None and len(kept) == len(names):
            return kept
        if len(self._kept) >= self.KEEP:
            self._kept.clear()
        mk = self.max_k
        arms = [self.for_class(c).arm_for(c, batch_size) for c in names]
        out = np.array([(METHOD_CODES[a.method], min(a.k, mk)) for a in arms], dtype=np.int64)
        self._kept[stretch] = out = out.reshape(len(names), 2)
        return out


def pick_drafts(
    src: np.ndarray, n: np.ndarray, configured: Sequence[Sequence[int]], ngram: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Per request the first ``n[j]`` tokens of the draft ``src[j]`` names (see ``source_row``), each a
    new list (a slice of a list is one)."""
    if configured and type(configured[0]) is not list:
        configured = [list(c) for c in configured]
    if ngram and type(ngram[0]) is not list:
        ngram = [list(c) for c in ngram]
    # One comprehension, no numpy call: on the engine's hot path a numpy call costs more than a row.
    return [
        ((c if s == _CONFIGURED else g)[:k] if s else [])  # type: ignore[misc]
        for s, k, c, g in zip(src.tolist(), n.tolist(), configured, ngram, strict=True)
    ]


#: Draft sources (``source_row``): none, the configured drafter's, n-gram's.
_NONE, _CONFIGURED, NGRAM_DRAFT = 0, 1, 2


@kernel
def source_row(m: int, k: int, ngram_len: int, composite: bool) -> tuple[int, int]:
    """Which draft a request gets (none, configured, n-gram) and how many of its tokens."""
    if m == _OFF or k <= 0:
        return _NONE, 0
    if m == _NGRAM and composite:
        return NGRAM_DRAFT, min(k, ngram_len)
    return _CONFIGURED, k


@kernel
def _sources(
    methods: np.ndarray, ks: np.ndarray, ngram_len: np.ndarray, composite: bool
) -> tuple[np.ndarray, np.ndarray]:
    src = np.zeros(len(methods), dtype=np.int64)
    n = np.zeros(len(methods), dtype=np.int64)
    for j in range(len(methods)):
        src[j], n[j] = source_row(int(methods[j]), int(ks[j]), int(ngram_len[j]), composite)
    return src, n
