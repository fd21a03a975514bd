"""controller/wire/convert.py ``directive_for_engine``: what an engine takes from its sidecar, treating the
sidecar as buggy or hostile.

What must hold: a directive it accepts can be applied by every engine (each lookup the engines make of it
by class and batch size, the rule's arguments) without an exception; one it refuses raises ValueError
naming the field, in one line that quotes no control character and stays short, however large the
message; every directive a sidecar makes comes back as it went (its rule's parameters resolved).

Before it, the engines took ``directive_from_pb``'s output as it came: an unknown rule kind or a rule
without its parameters (KeyError in ``rule_args``) and a K table entry above 64 with no plan entry
covering it (ValueError in ``Directive.arm_for``) raised inside the vLLM plugin's hooks, which then
disabled the plugin for the engine's lifetime; a table of half a million ranges took the engine's
thread a minute to tabulate.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.validation import MAX_SEQUENCE, Limits, read_batch, validate_hello
from controller.wire.convert import (
    MAX_K_RANGES,
    MAX_PLAN_ENTRIES,
    MAX_PLAN_PER_CLASS,
    directive_for_engine,
    directive_to_pb,
)
from controller.wire.link import LinkCore
from controller.wire.names import has_control
from policies.arms import MAX_K, Arm, Method
from policies.directive import Directive, KRange, PlanEntry
from policies.rules import RULES, rule_args, validate_rule

U32 = st.integers(0, 2**32 - 1)
CLASSES = ["*", "default", "code", "chat", ""]


def _ok(**kw: object) -> pb.Directive:
    base: dict[str, object] = {"version": 7, "policy": "p", "ttl_s": 30.0, "method": "eagle3",
                               "k_table": [pb.KRange(bs_min=1, bs_max=0, k=2)]}  # fmt: skip
    base.update(kw)
    return pb.Directive(**base)  # type: ignore[arg-type]


def _refused(msg: pb.Directive) -> str:
    with pytest.raises(ValueError) as err:
        directive_for_engine(pb.Directive.FromString(msg.SerializeToString()))
    text = str(err.value)
    assert "\n" not in text and "\r" not in text and len(text) <= 400, text
    return text


def _applies(d: Directive, max_k: int = 4, batch_sizes: range = range(0, 70)) -> None:
    """Every lookup an engine makes of ``d``: the rule's arguments, the K table and each class's arm."""
    rule_args(d)
    float(d.rule.params.get("alpha", 0.3))
    for bs in batch_sizes:
        assert 0 <= d.k_for_batch(bs, max_k) <= max_k
        assert 0 <= d.width_for_batch(bs, max_k) <= max_k
        for c in CLASSES:
            d.arm_for(c, bs)


BAD = [
    (_ok(rule=pb.RequestRule(kind="bogus")), r"^rule\.kind: unknown rule 'bogus'"),
    (_ok(rule=pb.RequestRule(kind="ngram_span", params={"alpha": float("nan")})), r"^rule\.params\.alpha: "),
    (_ok(rule=pb.RequestRule(kind="ngram_margin", params={"margin": 1e300})), r"^rule\.params\.margin: "),
    (_ok(rule=pb.RequestRule(kind="none", params={"alpha": 0.5})), r"^rule\.params\.alpha: unknown"),
    (_ok(version=0), r"^version: 0 is the engine's own safe default"),
    (_ok(version=MAX_SEQUENCE + 1), rf"^version: {MAX_SEQUENCE + 1} is beyond {MAX_SEQUENCE}"),
    (_ok(ttl_s=float("nan")), r"^ttl_s: not a number"),
    (_ok(k_table=[pb.KRange(bs_min=1, k=MAX_K + 1)]), rf"^k_table\[0\]\.k: at most {MAX_K}, got {MAX_K + 1}"),
    (_ok(k_table=[pb.KRange(bs_min=9, k=1), pb.KRange(bs_min=1, k=2**32 - 1)]), r"^k_table\[1\]\.k: "),
    (_ok(k_table=[pb.KRange(bs_min=2, bs_max=1, k=1)] * (MAX_K_RANGES + 1)), r"^k_table: 65 ranges"),
    (_ok(method="warp-drive"), r"^method: unknown method 'warp-drive'"),
    (_ok(plan=[pb.PlanEntry(traffic_class="*", bs_min=1, arm=pb.Arm(method="eagle3", k=0))]),
     r"^plan\[0\]\.arm: "),
    (_ok(plan=[pb.PlanEntry(traffic_class="*", bs_min=1, arm=pb.Arm(method="eagle3", k=2)),
               pb.PlanEntry(traffic_class="x", bs_min=1, arm=pb.Arm(method="", k=2))]),
     r"^plan\[1\]\.arm\.method: unknown method ''"),
    (_ok(plan=[pb.PlanEntry(traffic_class="code", bs_min=1 + i, bs_max=1 + i, arm=pb.Arm(method="off"))
               for i in range(MAX_PLAN_PER_CLASS + 1)]),
     rf"^plan: {MAX_PLAN_PER_CLASS + 1} entries for traffic class 'code'"),
    (_ok(plan=[pb.PlanEntry(traffic_class=f"c{i % 300}", bs_min=1, arm=pb.Arm(method="off"))
               for i in range(MAX_PLAN_ENTRIES + 1)]),
     rf"^plan: {MAX_PLAN_ENTRIES + 1} entries, more than"),
]  # fmt: skip


@pytest.mark.parametrize(("msg", "reason"), BAD)
def test_a_directive_an_engine_cannot_apply_is_refused_naming_the_field(
    msg: pb.Directive, reason: str
) -> None:
    assert re.search(reason, _refused(msg))


@pytest.mark.parametrize(
    "msg",
    [
        _ok(method="warp\ndrive" * 100_000),
        _ok(rule=pb.RequestRule(kind="\u202e" + "x" * 1_000_000)),
        _ok(rule=pb.RequestRule(kind="ngram_span", params={"fake\nspeccontrol: forged line" * 10_000: 1.0})),
        _ok(plan=[pb.PlanEntry(traffic_class="a\n" * 100_000, bs_min=i, arm=pb.Arm(method="off"))
                  for i in range(MAX_PLAN_PER_CLASS + 1)]),
    ],
)  # fmt: skip
def test_the_refusal_quotes_the_sidecars_text_escaped_and_cut(msg: pb.Directive) -> None:
    assert not has_control(_refused(msg))


def test_a_rule_without_its_parameters_runs_on_their_defaults() -> None:
    for kind in RULES:
        d = directive_for_engine(_ok(rule=pb.RequestRule(kind=kind)))
        assert d.rule == validate_rule(kind, {})
        _applies(d)


def test_a_k_above_the_engines_own_is_taken_and_clamped_by_the_engine() -> None:
    d = directive_for_engine(_ok(k_table=[pb.KRange(bs_min=1, k=MAX_K)]))
    assert d.k_for_batch(5, 4) == 4 and d.arm_for("code", 5) == Arm(Method.EAGLE3, MAX_K)
    assert directive_for_engine(_ok(k_table=[pb.KRange(bs_min=1, k=0)])).k_for_batch(5, 4) == 0


def test_tables_as_large_as_the_limits_are_taken() -> None:
    plan = [pb.PlanEntry(traffic_class=f"c{i // MAX_PLAN_PER_CLASS}", bs_min=1 + i % MAX_PLAN_PER_CLASS,
                         bs_max=1 + i % MAX_PLAN_PER_CLASS, arm=pb.Arm(method="ngram", k=3))
            for i in range(MAX_PLAN_ENTRIES)]  # fmt: skip
    msg = _ok(
        k_table=[pb.KRange(bs_min=1 + i, bs_max=1 + i, k=i % 5) for i in range(MAX_K_RANGES)], plan=plan
    )
    d = directive_for_engine(msg)
    assert len(d.k_table) == MAX_K_RANGES and len(d.plan) == MAX_PLAN_ENTRIES


def test_the_version_in_force_is_one_the_sidecar_takes_back_in_reports() -> None:
    # Every step the engine reports carries the version of the directive in force
    # (StepReport.directive_version), and the sidecar refuses a report whose version is beyond
    # MAX_SEQUENCE. Taken, a directive numbered 2^63 made every later report refused: the stream ended
    # after each batch, the engine reattached and got it again, and its telemetry was lost for good.
    bad = _ok(version=2**63)
    _refused(bad)
    last = directive_for_engine(_ok(version=MAX_SEQUENCE))
    step = pb.StepReport(time_s=1.0, duration_s=0.02, batch_size=1, directive_version=last.version)
    hello = pb.Hello(engine_id="e", max_k=4, arms=[pb.Arm(method="eagle3", k=2)], protocol_version=1)
    read_batch(pb.StepReportBatch(sequence=1, steps=[step]), validate_hello(hello), Limits())


def test_the_link_counts_a_refused_directive_and_keeps_nothing_of_it() -> None:
    core: LinkCore[int] = LinkCore(encode=lambda s, p: pb.StepReport(), queue_steps=4, resend_steps=4)
    core.opened()
    good = core.received(_ok())
    for msg, _ in BAD:
        with pytest.raises(ValueError):
            core.received(msg)
    s = core.stats()
    assert (s.directives, s.bad_directives) == (1, len(BAD)) and good.version == 7


@st.composite
def hostile(draw: st.DrawFn) -> pb.Directive:
    """Any directive a buggy or compromised sidecar could send, sizes within what a test can build."""
    methods = st.sampled_from(["eagle3", "p_eagle", "ngram", "off", "", "bogus"])
    kinds = st.sampled_from(["none", "ngram_margin", "ngram_span", "", "bogus"])
    params = st.dictionaries(
        st.sampled_from(["margin", "alpha", "warmup_steps", "min_run", "when_off", "fresh_k", "x"]),
        st.floats() | st.sampled_from([0.0, 1.0, 2.0, 64.0, 65.0, -1.0, 2.0**63]),
        max_size=5,
    )
    small = st.integers(0, 70) | U32
    return pb.Directive(
        version=draw(st.integers(0, 3) | st.integers(0, 2**64 - 1)),
        ttl_s=draw(st.floats()),
        method=draw(methods),
        k_table=[pb.KRange(bs_min=a, bs_max=b, k=k)
                 for a, b, k in draw(st.lists(st.tuples(small, small, small), max_size=8))],
        plan=[pb.PlanEntry(traffic_class=c, bs_min=a, bs_max=b, arm=pb.Arm(method=m, k=k))
              for c, a, b, m, k in draw(st.lists(st.tuples(st.sampled_from(CLASSES), small, small, methods, small),
                                                 max_size=8))],
        rule=pb.RequestRule(kind=draw(kinds), params=draw(params)),
    )  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile())
def test_whatever_a_sidecar_sends_is_refused_or_applies(msg: pb.Directive) -> None:
    try:
        d = directive_for_engine(pb.Directive.FromString(msg.SerializeToString()))
    except ValueError as e:
        assert "\n" not in str(e)
        return
    _applies(d, batch_sizes=range(0, 80, 3))


@settings(max_examples=200, deadline=None)
@given(
    st.builds(
        Directive,
        version=st.integers(1, MAX_SEQUENCE),  # (a sidecar's counter stops there: controller.state)
        policy=st.text(max_size=40),
        reason=st.text(max_size=40),
        ttl_s=st.floats(allow_nan=False),
        issued_at_s=st.floats(allow_nan=False),
        k_table=st.lists(st.builds(KRange, U32, U32, st.integers(0, MAX_K)), max_size=33).map(tuple),
        method=st.sampled_from(list(Method)),
        plan=st.lists(
            st.builds(PlanEntry, st.sampled_from(CLASSES), U32, U32,
                      st.sampled_from([Arm(Method.OFF, 0), Arm(Method.EAGLE3, 1), Arm(Method.NGRAM, MAX_K)])),
            max_size=60,
        ).map(tuple),
        rule=st.sampled_from([validate_rule("none", {}), validate_rule("ngram_span", {"when_off": 0}),
                              validate_rule("ngram_margin", {"margin": 1.5})]),
    )
)  # fmt: skip
def test_every_directive_a_sidecar_makes_is_taken_as_it_went(d: Directive) -> None:
    assert directive_for_engine(pb.Directive.FromString(directive_to_pb(d).SerializeToString())) == d
