from __future__ import annotations

import numpy as np
import pytest

from controller.vllm.control import Controls, engine_info
from policies.arms import METHOD_CODES, Arm, Method
from policies.context import ANY_CLASS
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.engine import Granularity
from tests.policies.directives import make_directive

E, N, OFF = METHOD_CODES[Method.EAGLE3], METHOD_CODES[Method.NGRAM], METHOD_CODES[Method.OFF]


def _controls(method: Method = Method.EAGLE3, composite: bool = True) -> Controls:
    info = engine_info(
        engine_id="e", model="m", method=method, max_k=4, max_batch_size=8, composite=composite
    )
    return Controls(engine=info, method=method, safe_default=Arm(method, 4), composite=composite)


def _directive(
    *plan: PlanEntry, table: tuple[KRange, ...] = (), rule: RequestRule | None = None
) -> Directive:
    return make_directive(version=7, k_table=table, plan=plan, rule=rule)


def test_hello_advertises_composite_or_batch_arms() -> None:
    info = engine_info(
        engine_id="e", model="m", method=Method.EAGLE3, max_k=2, max_batch_size=8, composite=True
    )
    assert info.granularity is Granularity.REQUEST_METHOD
    assert [str(a) for a in info.arms] == ["eagle3:1", "eagle3:2", "ngram:1", "ngram:2", "off"]
    assert info.counterfactual_methods == (Method.NGRAM,)
    plain = engine_info(
        engine_id="e", model="m", method=Method.NGRAM, max_k=2, max_batch_size=8, composite=False
    )
    assert plain.granularity is Granularity.BATCH_STEP
    assert [str(a) for a in plain.arms] == ["ngram:1", "ngram:2", "off"]
    assert plain.counterfactual_methods == ()


def test_k_table_clamped_and_safe_default_when_stale() -> None:
    c = _controls()
    d = _directive(table=(KRange(1, 2, 9), KRange(3, 0, 0)))
    assert c.k_table(d) == [4, 4, 4, 0, 0, 0, 0, 0, 0]
    assert c.in_force(None).version == 0
    assert c.k_table(c.in_force(None)) == [4] * 9
    assert c.in_force(d) is d


@pytest.mark.parametrize("placeholders", [False, True])
@pytest.mark.parametrize("composite", [False, True])
def test_an_engine_started_with_a_k_per_batch_size_runs_that_table_on_its_own(
    placeholders: bool, composite: bool
) -> None:
    # vLLM's dynamic_sd_lookup of --speculative-config num_speculative_tokens_per_batch_size
    # [[1, 2, 4], [3, 5, 2], [6, 8, 1]]: before the first directive and after one lapses the engine
    # ran K 4 at every batch size (its largest), not as it was started.
    lookup = [4, 4, 4, 2, 2, 2, 1, 1, 1]
    info = engine_info(engine_id="e", model="m", method=Method.EAGLE3, max_k=4, max_batch_size=8,
                       composite=composite, table_ks={1, 2, 4})  # fmt: skip
    c = Controls(engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, 4), composite=composite,
                 table_ks={1, 2, 4}, placeholders=placeholders, safe_table=lookup)  # fmt: skip
    safe = c.in_force(None)
    assert safe.version == 0
    assert c.k_table(safe)[1:] == lookup[1:]
    assert [safe.arm_for("chat", bs).k for bs in range(1, 9)] == lookup[1:]


def test_under_async_scheduling_the_table_leaves_the_span_rule_room_to_max_k() -> None:
    # The table is the placeholders' width under async scheduling: the span rule's n-gram drafts run
    # to max K inside copy spans (EAGLE runs at its own rows' K, drafter_k). Synchronously, or
    # without the span rule, it is the directive's table; a bucket it turns off keeps 0 when the rule
    # leaves planned-off requests alone.
    info = engine_info(
        engine_id="e", model="m", method=Method.EAGLE3, max_k=4, max_batch_size=8, composite=True
    )
    table = (KRange(1, 2, 2), KRange(3, 0, 0))
    span = RequestRule("ngram_span", {"min_run": 2.0, "when_off": 1.0, "alpha": 0.3, "fresh_k": 0.0})
    span_not_off = RequestRule("ngram_span", {"min_run": 2.0, "when_off": 0.0, "alpha": 0.3, "fresh_k": 0.0})
    async_c = Controls(engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, 4), composite=True,
                       placeholders=True)  # fmt: skip
    assert async_c.k_table(_directive(table=table, rule=span)) == [4] * 9
    assert async_c.k_table(_directive(table=table, rule=span_not_off)) == [4, 4, 4, 0, 0, 0, 0, 0, 0]
    assert async_c.k_table(_directive(table=table)) == [4, 2, 2, 0, 0, 0, 0, 0, 0]
    assert _controls().k_table(_directive(table=table, rule=span)) == [4, 2, 2, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    ("method", "composite", "safe", "runs_as"),
    [
        (Method.EAGLE3, True, "eagle3:2", "eagle3:2"),
        (Method.EAGLE3, True, "ngram:3", "ngram:3"),  # the composite drafter drafts n-gram too
        (Method.EAGLE3, False, "ngram:3", "eagle3:3"),  # K table only: its own method
        (Method.EAGLE3, True, "p_eagle:3", "eagle3:3"),  # other weights: not this engine's head
        (Method.EAGLE3, True, "eagle3:9", "eagle3:4"),  # K at most the engine's max
        (Method.P_EAGLE, True, "eagle3:2", "p_eagle:2"),
        (Method.NGRAM, False, "eagle3:2", "ngram:2"),
        (Method.EAGLE3, True, "off", "off"),
    ],
)
def test_safe_arm_is_what_the_engine_makes_of_its_safe_default(
    method: Method, composite: bool, safe: str, runs_as: str
) -> None:
    info = engine_info(
        engine_id="e", model="m", method=method, max_k=4, max_batch_size=8, composite=composite
    )
    c = Controls(engine=info, method=method, safe_default=Arm.parse(safe), composite=composite)
    assert str(c.safe_arm) == runs_as
    # and it is what the safe directive's plan gives every request, at any batch size and class mix
    for n in (1, 8, 512):
        ids = [f"r{n}-{i}" for i in range(n)]
        plan = c.plan(c.in_force(None), ids, [("chat", "code", "default")[i % 3] for i in range(n)], n)
        assert set(zip(plan.method.tolist(), plan.k.tolist(), strict=True)) == {
            (METHOD_CODES[c.safe_arm.method], c.safe_arm.k)
        }


def test_p_eagle_table_only_zero_or_max() -> None:
    c = _controls(Method.P_EAGLE)
    assert c.k_table(_directive(table=(KRange(1, 1, 2), KRange(2, 0, 0)))) == [4, 4] + [0] * 7


def test_plan_per_class_and_drafts_cut_to_k() -> None:
    c = _controls()
    d = _directive(
        PlanEntry("code", 1, 0, Arm(Method.NGRAM, 2)),
        PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 3)),
        PlanEntry("bulk", 1, 0, Arm(Method.OFF, 0)),
    )
    p = c.plan(d, ["a", "b", "c"], ["code", "chat", "bulk"], 3)
    assert p.method.tolist() == [N, E, OFF] and p.k.tolist() == [2, 3, 0]
    eagle = [[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]]
    ngram = [[9, 8, 7, 0], [6, 0, 0, 0], [0, 0, 0, 0]]
    assert c.choose_drafts(p, eagle, ngram, np.array([3, 1, 0])) == [[9, 8], [2, 2, 2], []]


def test_without_composite_ngram_plan_falls_back_to_configured_method() -> None:
    c = _controls(composite=False)
    p = c.plan(_directive(PlanEntry(ANY_CLASS, 1, 0, Arm(Method.NGRAM, 2))), ["a"], ["x"], 1)
    assert p.method.tolist() == [E] and p.k.tolist() == [2]


def test_rule_moves_a_request_to_ngram_from_its_feedback() -> None:
    c = _controls()
    d = _directive(
        PlanEntry(ANY_CLASS, 1, 0, Arm(Method.EAGLE3, 4)),
        rule=RequestRule("ngram_margin", {"margin": 0.5, "alpha": 0.5, "warmup_steps": 2}),
    )
    ids = ["good", "bad"]
    for _ in range(3):
        c.fast.feedback(
            ids,
            np.array([E, E], dtype=np.int8),
            np.array([0, 0]),
            {Method.NGRAM: np.array([4, 0], dtype=np.int32)},
        )
    p = c.plan(d, ids, ["x", "x"], 2)
    assert p.method.tolist() == [N, E]


def test_table_only_uses_the_k_values_vllm_prepared() -> None:
    """Started with num_speculative_tokens_per_batch_size, vLLM prepared only those K: a table K in
    between is raised to the next prepared one (the composite drafter cuts drafts per request), 0 stays
    0, and without the composite drafter only the prepared K are offered as arms."""
    info = engine_info(
        engine_id="e",
        model="m",
        method=Method.EAGLE3,
        max_k=4,
        max_batch_size=8,
        composite=True,
        table_ks={2, 4},
    )
    c = Controls(
        engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, 4), composite=True, table_ks={2, 4}
    )
    d = _directive(
        table=(KRange(1, 1, 1), KRange(2, 2, 2), KRange(3, 3, 3), KRange(4, 4, 4), KRange(5, 0, 0))
    )
    assert c.k_table(d) == [4, 2, 2, 4, 4, 0, 0, 0, 0]
    assert [str(a) for a in info.arms][:4] == ["eagle3:1", "eagle3:2", "eagle3:3", "eagle3:4"]
    table_only = engine_info(
        engine_id="e",
        model="m",
        method=Method.EAGLE3,
        max_k=4,
        max_batch_size=8,
        composite=False,
        table_ks={0, 2, 4},
    )
    assert [str(a) for a in table_only.arms] == ["eagle3:2", "eagle3:4", "off"]


def test_a_directive_reusing_a_version_and_policy_name_gets_its_own_table() -> None:
    # A sidecar that restarted without its state numbers from 1 again: the same version and policy
    # name may carry another table, which must not be served from the cache of the old one.
    c = _controls()
    first = _directive(table=(KRange(1, 0, 4),))
    assert c.k_table(first) == [4] * 9
    again = _directive(table=(KRange(1, 0, 1),))
    assert (again.version, again.policy) == (first.version, first.policy)
    assert c.k_table(again) == [4] + [1] * 8
