"""YAML 1.2 floats (``1e-3``) in the project's YAML files (policies.yamldoc, shared by policies, the
sidecar's config and cost-model profiles): numbers, where PyYAML's YAML 1.1 read them as strings and
``decision_interval_s: 1e-1`` was refused "expected a number, got str". Nothing else changes type."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import yaml

from controller.config import parse_config
from controller.errors import ConfigError
from policies import yamldoc
from policies.spec import parse_policy, render_policy


def _load(text: str) -> Any:
    return yamldoc.load(text, max_depth=8, max_nodes=100)[0]


@pytest.mark.parametrize(
    ("scalar", "value"),
    [("1e-3", 1e-3), ("1E3", 1000.0), ("-2e-2", -0.02), ("+1e5", 1e5), (".5e2", 50.0), ("1.e1", 10.0),
     ("1.0e3", 1000.0), ("1.0e+3", 1000.0), ("0e0", 0.0)],
)  # fmt: skip
def test_exponent_floats_are_numbers(scalar: str, value: float) -> None:
    got = _load(f"a: {scalar}\n")["a"]
    assert type(got) is float and got == value


@pytest.mark.parametrize(
    "scalar",
    ["1", "0x1F", "1_000", "1.5", ".inf", "-.inf", "true", "off", "yes", "null", "~", "",
     "2001-12-14", "1e", "e3", "1e3x", "1e+", "'1e3'", '"1e-3"', "!!str 1e3", "eagle3:3", "1.2.3"],
)  # fmt: skip
def test_every_other_scalar_resolves_as_yaml_1_1_does(scalar: str) -> None:
    # (but 010 and 1:20, which YAML 1.1 alone reads as numbers: refused, test_yamldoc_yaml11_numbers.py)
    text = f"a: {scalar}\n"
    got, want = _load(text)["a"], yaml.safe_load(text)["a"]
    assert got == want and type(got) is type(want)
    assert not isinstance(got, float) or scalar in ("1.5", ".inf", "-.inf")
    assert _load("d: 2001-12-14\n")["d"] == datetime.date(2001, 12, 14)


def test_the_dumper_quotes_strings_the_loader_reads_as_numbers() -> None:
    doc = {"s": "1e-3", "t": "1E3", "u": "x1e3", "f": 1e-7, "i": 3}
    text = yaml.dump(doc, Dumper=yamldoc.Dumper, sort_keys=False)
    assert text == "s: '1e-3'\nt: '1E3'\nu: x1e3\nf: 1.0e-07\ni: 3\n"
    assert _load(text) == doc


POLICY = """apiVersion: speccontrol/v1
kind: Policy
metadata: {name: tiny, description: 5e2}
spec:
  algorithm: {name: goodput_model, params: {ridge: 1e-3, memory_steps: 2e3}}
  decision_interval_s: 1e-1
  switch_margin: 2E-2
  rule: {kind: ngram_margin, params: {margin: 5e-1}}
  slo: {p99_tpot_ms: 5e1}
"""


def test_a_policy_takes_exponent_numbers() -> None:
    spec = parse_policy(POLICY, source="p.yaml")
    assert spec.decision_interval_s == 0.1 and spec.switch_margin == 0.02
    assert spec.params["ridge"] == 1e-3 and spec.params["memory_steps"] == 2000.0
    assert spec.rule.params["margin"] == 0.5 and spec.slo["p99_tpot_ms"] == 50.0
    assert spec.description == "5e2"  # a field that takes text keeps it as written
    assert parse_policy(render_policy(spec)) == spec


def test_a_policy_named_like_a_number_keeps_its_name() -> None:
    spec = parse_policy(POLICY.replace("name: tiny", "name: 1e3"), source="p.yaml")
    assert spec.name == "1e3"
    assert "name: '1e3'" in render_policy(spec)


def test_integer_fields_take_integral_exponents_only() -> None:
    assert parse_policy(POLICY.replace("  decision_interval_s: 1e-1", "  seed: 1e3")).seed == 1000
    with pytest.raises(ValueError, match=r"^p\.yaml:6: spec\.seed: expected an integer, got 0\.001$"):
        parse_policy(POLICY.replace("  decision_interval_s: 1e-1", "  seed: 1e-3"), source="p.yaml")


def test_the_sidecar_config_takes_exponent_numbers() -> None:
    c = parse_config(
        "decision_tick_s: 1e-2\nack_interval_s: 5E-2\nmax_engine_steps_per_s: 1e5\n", source="c.yaml"
    )
    assert (c.decision_tick_s, c.ack_interval_s, c.max_engine_steps_per_s) == (0.01, 0.05, 1e5)
    with pytest.raises(ConfigError) as e:
        parse_config("decision_tick_s: 1e-3\n", source="c.yaml")
    assert str(e.value) == "c.yaml:1: decision_tick_s: must be between 0.005 and 60.0, got 0.001"
    with pytest.raises(ConfigError, match=r"c\.yaml:1: max_engines: expected an integer, got float 1000\.0"):
        parse_config("max_engines: 1e3\n", source="c.yaml")


def test_sidecar_text_settings_written_like_numbers_keep_their_text() -> None:
    # Read as floats by the YAML 1.2 rule, they were refused ("fleet: expected a string, got float
    # 1000.0"), where YAML 1.1 had read them as the text written.
    c = parse_config("fleet: 1e3\nnode_id: 2E5\nlog_level: INFO\ndecision_tick_s: 1e-2\n", source="c.yaml")
    assert (c.fleet, c.node_id, c.decision_tick_s) == ("1e3", "2E5", 0.01)
