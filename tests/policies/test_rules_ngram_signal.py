"""The ``ngram_span`` rule with the n-gram proposer's match (``ngram_proposal``), and without it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.arms import METHOD_CODES, Arm, Method
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.observation import NOT_SCORED
from policies.rules import FastLoop, method_names
from tests.policies.directives import make_directive

NG = METHOD_CODES[Method.NGRAM]
EA = METHOD_CODES[Method.EAGLE3]
OFF = METHOD_CODES[Method.OFF]
RULE = RequestRule("ngram_span", {"min_run": 2.0, "when_off": 1, "alpha": 0.3, "fresh_k": 0})


def directive(rule: RequestRule = RULE, k: int = 3, off_class: bool = False) -> Directive:
    plan = [PlanEntry("*", 1, 0, Arm(Method.EAGLE3, k))]
    if off_class:
        plan.insert(0, PlanEntry("hard", 1, 0, Arm(Method.OFF, 0)))
    return make_directive(k_table=(KRange(1, 0, k),), plan=plan, rule=rule)


def test_no_match_never_drafts_ngram_even_inside_a_known_span() -> None:
    fl = FastLoop()
    d = directive()
    ids = ["a", "b"]
    m, k = fl.plan(d, ids, ["chat", "chat"], 2, 8)
    # Both were scored: n-gram would have accepted 6 after each (a span), the step emitted 1 + 1.
    fl.feedback(ids, m, np.array([1, 1]), {Method.NGRAM: np.array([6, 6])})
    m, k = fl.plan(d, ids, ["chat", "chat"], 2, 8, ngram_proposal=np.array([8, 0]))
    assert method_names(m) == ["ngram", "eagle3"]
    assert k.tolist() == [4, 3]  # the known run (6 - 2), and the planned K where n-gram has no match


def test_a_fresh_match_drafts_the_whole_proposal() -> None:
    fl = FastLoop()
    d = directive()
    ids = ["new", "capped", "never-scored"]
    m, _ = fl.plan(d, ids[:2], ["chat"] * 2, 3, 8)
    # The last draft accepted nothing past the step: the next position is past any span it knew.
    fl.feedback(ids[:2], m, np.array([2, 2]), {Method.NGRAM: np.array([0, 0])})
    m, k = fl.plan(d, ids, ["chat"] * 3, 3, 8, ngram_proposal=np.array([8, 5, 8]))
    assert method_names(m) == ["ngram", "ngram", "ngram"]
    assert k.tolist() == [8, 5, 8]  # capped by the proposal (the history ran out)
    # Without the signal the same state drafts EAGLE-3: the rule cannot know a span started.
    m, k = fl.plan(d, ids[:2], ["chat"] * 2, 2, 8)
    assert method_names(m) == ["eagle3", "eagle3"] and k.tolist() == [3, 3]


def test_fresh_k_caps_a_fresh_draft() -> None:
    fl = FastLoop()
    d = directive(RequestRule("ngram_span", {**RULE.params, "fresh_k": 3}))
    m, k = fl.plan(d, ["a"], ["chat"], 1, 8, ngram_proposal=np.array([8]))
    assert method_names(m) == ["ngram"] and k.tolist() == [3]


def test_a_match_where_the_known_span_ends_is_not_drafted() -> None:
    """EAGLE-3 emitted 3 tokens where n-gram would have accepted 3: the request stands on the copy's
    last token, whose continuation is known to be wrong, so the proposer's match there is not drafted.
    After a rejected n-gram draft, by contrast, the bonus token is past the span: a match is fresh."""
    fl = FastLoop()
    d = directive()
    m, _ = fl.plan(d, ["a", "b"], ["chat"] * 2, 2, 8)
    fl.feedback(["a", "b"], m, np.array([2, 2]), {Method.NGRAM: np.array([3, 2])})
    m, k = fl.plan(d, ["a", "b"], ["chat"] * 2, 2, 8, ngram_proposal=np.array([8, 8]))
    assert method_names(m) == ["eagle3", "ngram"] and k.tolist() == [3, 8]
    fl.feedback(["a", "b"], m, np.array([1, 3]), {Method.NGRAM: np.array([0, NOT_SCORED])})
    m, k = fl.plan(d, ["a", "b"], ["chat"] * 2, 2, 8, ngram_proposal=np.array([8, 8]))
    assert method_names(m) == ["ngram", "ngram"] and k.tolist() == [8, 8]


def test_a_draft_cut_by_k_goes_on_while_the_match_holds() -> None:
    fl = FastLoop()
    d = directive()
    m, k = fl.plan(d, ["a"], ["chat"], 1, 8, ngram_proposal=np.array([8]))
    fl.feedback(["a"], m, k.astype(np.int64), {Method.NGRAM: np.array([NOT_SCORED])})  # accepted all 8
    m, k = fl.plan(d, ["a"], ["chat"], 1, 8, ngram_proposal=np.array([8]))
    assert method_names(m) == ["ngram"] and k.tolist() == [8]


def test_a_span_ends_or_goes_on_by_the_verified_drafts_length_not_the_k_planned_since() -> None:
    # The plugin plans the next draft before this one's feedback (async) and vLLM's placeholders may
    # cut a draft below its plan: "cut at K" must be judged against the draft verified.
    def run_after(drafted: int, accepted: int, plan_again: int | None) -> float:
        fl = FastLoop()
        d = directive()
        m, k = fl.plan(d, ["a"], ["chat"], 1, 8, ngram_proposal=np.array([8]))
        assert method_names(m) == ["ngram"] and k.tolist() == [8]
        if plan_again is not None:  # the next draft planned first, at another K
            fl.plan(d, ["a"], ["chat"], 1, 8, ngram_proposal=np.array([plan_again]))
        fl.feedback(["a"], m, np.array([accepted]), {}, drafted=np.array([drafted]))
        return float(fl.arrays()[2][fl.slots(["a"])[0]])

    assert run_after(8, 5, plan_again=2) < 0  # 5 of the 8 verified: the span ended
    assert run_after(3, 3, plan_again=None) == 8  # all 3 the placeholders let through: it goes on
    assert run_after(8, 8, plan_again=None) == 8


def test_when_off_zero_keeps_planned_off_requests_off() -> None:
    fl = FastLoop()
    d = directive(RequestRule("ngram_span", {**RULE.params, "when_off": 0}), off_class=True)
    m, _ = fl.plan(d, ["h", "c"], ["hard", "chat"], 2, 8, ngram_proposal=np.array([8, 8]))
    assert method_names(m) == ["off", "ngram"]


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 8), min_size=4, max_size=4),  # proposals
            st.lists(st.integers(0, 8), min_size=4, max_size=4),  # accepted / counterfactual
        ),
        min_size=1,
        max_size=12,
    )
)
def test_invariants_under_any_feedback(steps: list[tuple[list[int], list[int]]]) -> None:
    """Never n-gram without a match; K within 1..proposal for n-gram rows; the plan's K elsewhere."""
    fl = FastLoop()
    d = directive()
    ids = ["a", "b", "c", "d"]
    for props, accs in steps:
        prop = np.array(props)
        m, k = fl.plan(d, ids, ["chat"] * 4, 4, 8, ngram_proposal=prop)
        ng = m == NG
        assert not (ng & (prop == 0)).any()
        assert ((k[ng] >= 1) & (k[ng] <= prop[ng])).all()
        assert (m[~ng] == EA).all() and (k[~ng] == 3).all()
        acc = np.minimum(np.array(accs), k)
        cf = np.where(ng, NOT_SCORED, np.where(prop == 0, 0, np.array(accs)))
        fl.feedback(ids, m, acc, {Method.NGRAM: cf})


def test_without_the_signal_the_rule_is_unchanged() -> None:
    """The same feedback drives the same plan whether or not the proposal column exists elsewhere."""
    rng = np.random.default_rng(0)
    a, b = FastLoop(), FastLoop()
    d = directive()
    ids = [f"r{i}" for i in range(6)]
    for _ in range(50):
        ma, ka = a.plan(d, ids, ["chat"] * 6, 6, 8)
        mb, kb = b.plan(d, ids, ["chat"] * 6, 6, 8, ngram_proposal=None)
        assert ma.tolist() == mb.tolist() and ka.tolist() == kb.tolist()
        acc = rng.integers(0, 9, 6)
        cf = np.where(ma == NG, NOT_SCORED, rng.integers(0, 9, 6))
        a.feedback(ids, ma, np.minimum(acc, ka), {Method.NGRAM: cf})
        b.feedback(ids, mb, np.minimum(acc, kb), {Method.NGRAM: cf})
