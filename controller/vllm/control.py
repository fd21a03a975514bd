"""What the engine applies between steps: the directive in force (or the safe default), the
scheduler's batch-size -> K table, and the per-request plan (the fast loop), vectorised over the batch.

Pure: the vLLM hooks feed it request ids, classes and drafts, and copy its answers into the scheduler.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from policies.arms import METHOD_CODES, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import Directive, KRange, PlanEntry
from policies.engine import EngineInfo, Granularity
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
) -> EngineInfo:
    """REQUEST_METHOD with n-gram counterfactuals when the composite drafter is active; otherwise
    BATCH_STEP with the configured method's arms (the scheduler's K table is all it can change)."""
    return EngineInfo(
        engine_id=engine_id,
        model=model,
        max_k=max_k,
        arms=engine_arms(method, max_k, composite=composite, table_ks=table_ks),
        granularity=Granularity.REQUEST_METHOD if composite else Granularity.BATCH_STEP,
        max_batch_size=max_batch_size,
        counterfactual_methods=(Method.NGRAM,) if composite and method is not Method.NGRAM else (),
        # The composite drafter always has P-EAGLE draft max_k and truncates per request, which stays
        # aligned; vLLM's own reshape at 0 < K < max does not (llm_base_proposer.py:629-635).
        p_eagle_partial_k_safe=composite,
    )


def safe_default_directive(arm: Arm, *, max_k: int) -> Directive:
    """The engine's fail-static directive (version 0)."""
    k = min(arm.k, max_k)
    return Directive(
        version=0,
        policy="safe-default",
        reason="no fresh directive from the sidecar",
        ttl_s=0.0,
        issued_at_s=0.0,
        k_table=(KRange(1, 0, k),),
        method=arm.method,
        plan=(PlanEntry(ANY_CLASS, 1, 0, arm),),
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
    ) -> None:
        self.engine = engine
        self.method = method
        self.composite = composite
        self.safe = safe_default_directive(safe_default, max_k=engine.max_k)
        self.fast = FastLoop(capacity=capacity)
        self._table_key: tuple[int, str] | None = None
        self._table: list[int] = []
        self._method_code = METHOD_CODES[method]
        #: The K values vLLM prepared at start-up (num_speculative_tokens_per_batch_size); a table
        #: K between them is raised to the next one (the composite drafter cuts drafts per request).
        self._table_ks = sorted({k for k in table_ks if 0 < k <= engine.max_k}) if table_ks else []

    def in_force(self, fresh: Directive | None) -> Directive:
        return self.safe if fresh is None else fresh

    def k_table(self, d: Directive) -> list[int]:
        """vLLM's ``dynamic_sd_lookup``: index = batch size (0..max_batch_size), clamped to max_k.

        P-EAGLE drafts either max_k or nothing (vLLM misaligns drafts in between); per-request K is
        then done by truncation in the composite drafter.
        """
        key = (d.version, d.policy)
        if key == self._table_key:
            return self._table
        n, mk = self.engine.max_batch_size, self.engine.max_k
        table = [d.k_for_batch(bs, mk) if bs else mk for bs in range(n + 1)]
        if self.method is Method.P_EAGLE:
            table = [mk if k > 0 else 0 for k in table]
        elif self._table_ks:
            top = self._table_ks[-1]
            table = [k if k <= 0 else next((t for t in self._table_ks if t >= k), top) for k in table]
        self._table_key, self._table = key, table
        return table

    def plan(self, d: Directive, request_ids: Sequence[str], classes: Sequence[str], batch_size: int) -> Plan:
        """The fast loop's choice for each request's next draft."""
        methods, ks = self.fast.plan(d, request_ids, classes, batch_size, self.engine.max_k)
        if not self.composite:
            # Only the configured method (or nothing) can be drafted without the composite drafter.
            methods = np.where(methods == _OFF, _OFF, self._method_code).astype(np.int8)
        else:
            allowed = (methods == _OFF) | (methods == _NGRAM) | (methods == self._method_code)
            methods = np.where(allowed, methods, self._method_code).astype(np.int8)
        ks = np.where(methods == _OFF, 0, ks).astype(np.int32)
        methods = np.where(ks == 0, _OFF, methods).astype(np.int8)
        return Plan(methods, ks)

    def choose_drafts(
        self,
        plan: Plan,
        configured: Sequence[Sequence[int]],
        ngram: Sequence[np.ndarray | None],
    ) -> list[list[int]]:
        """Per request: the configured drafter's draft, the n-gram draft or nothing, cut to its K."""
        out: list[list[int]] = []
        for j, (m, k) in enumerate(zip(plan.method.tolist(), plan.k.tolist(), strict=True)):
            if m == _OFF or k <= 0:
                out.append([])
            elif m == _NGRAM and self.composite:
                d = ngram[j]
                out.append([] if d is None else d[:k].tolist())
            else:
                out.append(list(configured[j][:k]))
        return out
