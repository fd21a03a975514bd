"""The fast loop's per-request rule."""

import numpy as np

from policies.arms import METHOD_CODES, Arm, Method
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.observation import NOT_SCORED
from policies.rules import FastLoop, method_names

NG = METHOD_CODES[Method.NGRAM]
EA = METHOD_CODES[Method.EAGLE3]


def directive(rule: RequestRule, k: int = 3) -> Directive:
    return Directive(
        version=1,
        policy="p",
        reason="",
        ttl_s=10,
        issued_at_s=0,
        k_table=(KRange(1, 0, k),),
        method=Method.EAGLE3,
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
