"""Directive lookups: the K table per batch size and the draft room an async engine leaves each request."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.directive import Directive, KRange, RequestRule
from policies.rules import validate_rule
from tests.policies.directives import make_directive


def _directive(table: tuple[KRange, ...], rule: RequestRule) -> Directive:
    return make_directive(k_table=table, rule=rule)


def test_the_span_rule_gets_room_to_max_k_and_other_rules_the_table() -> None:
    table = (KRange(1, 8, 3), KRange(9, 0, 0))
    span = _directive(table, validate_rule("ngram_span", {}))
    assert [span.width_for_batch(b, 8) for b in (1, 8, 9, 200)] == [8, 8, 8, 8]  # when_off: 1 (its default)
    not_off = _directive(table, validate_rule("ngram_span", {"when_off": 0}))
    assert [not_off.width_for_batch(b, 8) for b in (1, 9)] == [8, 0]  # nobody drafts in an off bucket
    for rule in (RequestRule(), validate_rule("ngram_margin", {})):  # the planned K stays
        d = _directive(table, rule)
        assert [d.width_for_batch(b, 8) for b in (1, 9)] == [d.k_for_batch(b, 8) for b in (1, 9)] == [3, 0]


@given(
    ks=st.lists(st.integers(0, 64), min_size=1, max_size=6),
    max_k=st.integers(0, 64),
    batch=st.integers(1, 4096),
    kind=st.sampled_from(["none", "ngram_margin", "ngram_span"]),
    when_off=st.integers(0, 1),
)
def test_the_room_is_never_below_the_table_nor_above_max_k(
    ks: list[int], max_k: int, batch: int, kind: str, when_off: int
) -> None:
    table = tuple(KRange(1 + 10 * i, 10 * (i + 1) if i < len(ks) - 1 else 0, k) for i, k in enumerate(ks))
    d = _directive(table, validate_rule(kind, {"when_off": when_off} if kind == "ngram_span" else {}))
    k, room = d.k_for_batch(batch, max_k), d.width_for_batch(batch, max_k)
    assert k <= room <= max_k
