"""controller/wire/convert.py: every valid directive and engine description comes back from the wire as
it went (``x_from_pb(x_to_pb(v)) == v``), through the serialised bytes as a peer receives them.

A field dropped on either side (a rule's parameters, a plan entry's class, a K range's bound) would make
engines run the rule's defaults or another plan silently: every other test builds its directives on one
side of the wire only.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.v1 import controller_pb2 as pb
from controller.wire.convert import (
    directive_from_pb,
    directive_to_pb,
    engine_info_from_hello,
    hello_from_engine_info,
)
from policies.arms import MAX_K, Arm, Method
from policies.directive import Directive, KRange, PlanEntry, RequestRule
from policies.engine import EngineInfo, Granularity

U32 = st.integers(0, 2**32 - 1)
# Unicode text as protobuf carries it (UTF-8: no lone surrogates, which hypothesis never draws).
TEXT = st.text(max_size=40)
DOUBLES = st.floats(allow_nan=False)  # NaN is never equal to itself; infinities and subnormals are in


@st.composite
def arms(draw: st.DrawFn) -> Arm:
    method = draw(st.sampled_from(list(Method)))
    return Arm(method, 0 if method is Method.OFF else draw(st.integers(1, MAX_K)))


RULES = st.builds(
    RequestRule,
    kind=st.sampled_from(["none", "ngram_margin", "ngram_span"]),
    params=st.dictionaries(st.text(min_size=1, max_size=20), DOUBLES, max_size=8),
)

DIRECTIVES = st.builds(
    Directive,
    version=st.integers(0, 2**64 - 1),
    policy=TEXT,
    reason=TEXT,
    ttl_s=DOUBLES,
    issued_at_s=DOUBLES,
    k_table=st.lists(st.builds(KRange, U32, U32, U32), max_size=64).map(tuple),
    method=st.sampled_from(list(Method)),
    plan=st.lists(st.builds(PlanEntry, TEXT, U32, U32, arms()), max_size=300).map(tuple),
    rule=RULES,
)


def _over_the_wire(msg: pb.Directive | pb.Hello) -> bytes:
    return msg.SerializeToString()


@settings(max_examples=300, deadline=None)
@given(DIRECTIVES)
def test_a_directive_comes_back_from_the_wire_as_it_went(d: Directive) -> None:
    received = pb.Directive.FromString(_over_the_wire(directive_to_pb(d)))
    assert directive_from_pb(received) == d


def test_a_full_directive_comes_back_whole() -> None:
    # One of every field at its edge, so a field the strategies might rarely fill is always covered.
    d = Directive(
        version=2**64 - 1,
        policy="default-tunéd",
        reason="drift: page_hinkley",
        ttl_s=10.5,
        issued_at_s=1.7e9,
        k_table=(KRange(1, 4, 5), KRange(5, 0, 0), KRange(2**32 - 1, 2**32 - 1, 2**32 - 1)),
        method=Method.P_EAGLE,
        plan=(PlanEntry("chat", 1, 8, Arm(Method.EAGLE3, MAX_K)), PlanEntry("*", 9, 0, Arm(Method.OFF, 0))),
        rule=RequestRule("ngram_span", {"fresh_k": 4.0, "min_run": 2.0, "when_off": 0.0, "margin": -1e-300}),
    )
    assert directive_from_pb(pb.Directive.FromString(_over_the_wire(directive_to_pb(d)))) == d


@settings(max_examples=200, deadline=None)
@given(
    st.builds(
        EngineInfo,
        engine_id=st.text(min_size=1, max_size=128),
        model=TEXT,
        max_k=st.integers(1, MAX_K),
        arms=st.lists(arms(), max_size=40).map(tuple),
        granularity=st.sampled_from(list(Granularity)),
        max_batch_size=st.integers(1, 2**32 - 1),
        counterfactual_methods=st.lists(st.sampled_from(list(Method)), max_size=4).map(tuple),
        p_eagle_partial_k_safe=st.booleans(),
    )
)
def test_an_engine_description_comes_back_from_its_hello(e: EngineInfo) -> None:
    received = pb.Hello.FromString(
        _over_the_wire(hello_from_engine_info(e, plugin_mode="per-request composite"))
    )
    assert engine_info_from_hello(received) == e
