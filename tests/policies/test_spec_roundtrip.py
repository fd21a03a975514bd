"""``parse_policy(render_policy(spec)) == spec`` for generated valid specs, field by field and type by type.

Each example starts from a preset and varies the documented fields within their documented ranges:
the algorithm and its parameters (each learner's ``PARAMS``: ``Param.lo``..``Param.hi``), arms, batch
buckets, per_class, the timing fields and seed (``policies.spec._SPEC_FIELDS``), the rule's kind and
parameters (``policies.rules.RULES``), the drift, slo and exploration sections and a Unicode
description. A renderer that drops or mistypes any of them fails here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from policies.algorithms import REGISTRY
from policies.arms import MAX_K, OFF, Arm, Method
from policies.context import MAX_BATCH_SIZE, BatchBuckets
from policies.directive import RequestRule
from policies.drift import DETECTORS, DRIFT_FIELDS
from policies.guards import EXPLORATION_FIELDS, SLO_FIELDS
from policies.params import Param
from policies.presets import load_preset, preset_names
from policies.rules import RULES
from policies.spec import _SPEC_FIELDS, MAX_ARMS, PolicySpec, parse_policy, render_policy

ARMS = [OFF, *(Arm(m, k) for m in (Method.EAGLE3, Method.P_EAGLE, Method.NGRAM) for k in range(1, MAX_K + 1))]
ARM_TEXT = st.sampled_from(ARMS).map(str) | st.just("off:0")
#: Valid text parameters, by name (the others are numbers with Param ranges).
TEXT_PARAMS: dict[str, st.SearchStrategy[str]] = {
    "arm": ARM_TEXT,
    "method": st.sampled_from(["eagle3", "p_eagle", "ngram"]),
    "schedule": st.lists(
        st.tuples(st.integers(1, 500), st.integers(0, 500), st.integers(0, MAX_K)), min_size=1, max_size=6
    ).map(lambda es: ",".join(f"{lo}-{lo + span}:{k}" if span else f"{lo}:{k}" for lo, span, k in es))
    | st.just("1+:3"),
    "detector": st.sampled_from(DETECTORS),
}
#: Names as name_problem takes them, and ones YAML would read as something else if left unquoted.
NAMES = st.from_regex(r"[A-Za-z0-9_.-]{1,128}", fullmatch=True).filter(
    lambda n: n not in (".", "..")
) | st.sampled_from(
    [
        "1e3",
        "1E-3",
        ".5e2",
        "1.0e3",
        "1.5",
        "1_000",
        "0x1F",
        "010",
        "true",
        "off",
        "null",
        "2001-12-14",
        ".inf",
    ]
)


def value_of(name: str, p: Param) -> st.SearchStrategy[Any]:
    if isinstance(p.default, str):
        return TEXT_PARAMS[name]
    if isinstance(p.default, int) and not isinstance(p.default, bool):
        assert p.lo is not None and p.hi is not None
        return st.integers(int(p.lo), int(p.hi))
    return st.floats(p.lo, p.hi, allow_nan=False, allow_infinity=False)


def section(schema: Mapping[str, Param], keep: Mapping[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Every field of ``schema``, in its order (as parse_policy resolves it): kept (the preset's or
    default value) or drawn in its range."""
    fields = st.fixed_dictionaries(
        {k: st.just(keep.get(k, p.default)) | value_of(k, p) for k, p in schema.items()}
    )
    return fields.map(lambda d: {k: d[k] for k in schema})


@st.composite
def specs(draw: st.DrawFn) -> PolicySpec:
    base = load_preset(draw(st.sampled_from(preset_names())))
    algorithm = draw(st.just(base.algorithm) | st.sampled_from(sorted(REGISTRY)))
    keep = base.params if algorithm == base.algorithm else {}
    params = draw(section(REGISTRY[algorithm].PARAMS, keep))
    kind = draw(st.just(base.rule.kind) | st.sampled_from(sorted(RULES)))
    rule = RequestRule(kind, draw(section(RULES[kind], base.rule.params if kind == base.rule.kind else {})))
    slo = draw(section(SLO_FIELDS, base.slo))
    if slo["min_samples"] > slo["window"]:  # documented: the guard needs min_samples <= window
        slo["min_samples"], slo["window"] = slo["window"], slo["min_samples"]
    bounds = draw(st.lists(st.integers(1, MAX_BATCH_SIZE), min_size=1, max_size=32, unique=True).map(sorted))
    scalars = draw(section(_SPEC_FIELDS, {f: getattr(base, f) for f in _SPEC_FIELDS}))
    return dataclasses.replace(
        base,
        name=draw(st.just(base.name) | NAMES),
        description=draw(st.just(base.description) | st.text(max_size=200)),
        algorithm=algorithm,
        params=params,
        arms=tuple(draw(st.lists(st.sampled_from(ARMS), unique=True, max_size=MAX_ARMS))),
        buckets=draw(st.just(base.buckets) | st.just(BatchBuckets(tuple(bounds)))),
        per_class=draw(st.booleans()),
        rule=rule,
        drift=draw(section(DRIFT_FIELDS, base.drift)),
        slo=slo,
        exploration=draw(section(EXPLORATION_FIELDS, base.exploration)),
        source_yaml="",
        **scalars,
    )


def assert_same_spec(got: PolicySpec, want: PolicySpec) -> None:
    """Equal as dataclasses, and every field (and every mapping's value) of the same type."""
    for f in dataclasses.fields(PolicySpec):
        if f.name == "source_yaml":
            continue
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a == b, f"{f.name}: {a!r} != {b!r}"
        assert type(a) is type(b), f"{f.name}: {type(a).__name__} != {type(b).__name__}"
        if isinstance(b, Mapping):
            assert list(a) == list(b), f.name
            for k in b:
                assert type(a[k]) is type(b[k]), f"{f.name}.{k}: {a[k]!r} vs {b[k]!r}"
    for k in want.rule.params:
        assert type(got.rule.params[k]) is type(want.rule.params[k]), f"rule.params.{k}"
    assert got == want


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[p for p in Phase if p is not Phase.explain],
)
@given(specs())
def test_render_then_parse_gives_the_spec_back(spec: PolicySpec) -> None:
    text = render_policy(spec)
    back = parse_policy(text, source="rendered")
    assert_same_spec(back, spec)
    assert back.source_yaml == text
    assert render_policy(back) == text  # rendering is canonical


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_round_trips(name: str) -> None:
    spec = load_preset(name)
    assert_same_spec(parse_policy(render_policy(spec)), spec)


def test_names_and_descriptions_that_read_as_numbers_stay_text() -> None:
    """``1e3`` is a number to YAML 1.2 (policies.yamldoc): rendered quoted, and read as written where
    a document written before leaves it plain."""
    spec = dataclasses.replace(load_preset("ucb1"), name="1e3", description="1E-3")
    text = render_policy(spec)
    assert "name: '1e3'" in text and "description: '1E-3'" in text
    assert_same_spec(parse_policy(text), spec)
    plain = text.replace("'1e3'", "1e3").replace("'1E-3'", "1E-3")
    assert_same_spec(parse_policy(plain), spec)
