"""Directives for tests: the fields every test leaves alone (policy name, reason, TTL, issue time) set
once, so a test names only what it is about (K table, plan, rule)."""

from __future__ import annotations

from collections.abc import Iterable

from policies.arms import Method
from policies.directive import Directive, KRange, PlanEntry, RequestRule


def make_directive(
    *,
    k_table: Iterable[KRange] = (),
    plan: Iterable[PlanEntry] = (),
    rule: RequestRule | None = None,
    version: int = 1,
    method: Method = Method.EAGLE3,
) -> Directive:
    return Directive(
        version=version,
        policy="p",
        reason="",
        ttl_s=10,
        issued_at_s=0,
        k_table=tuple(k_table),
        method=method,
        plan=tuple(plan),
        rule=rule or RequestRule(),
    )
