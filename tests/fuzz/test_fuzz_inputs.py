"""Fuzzed policy YAML, sidecar config, MQTT payloads and trace files: a clear one-line error (or a
valid result), never a crash, never a hang."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller._mqtt import BrokerSettings, Received
from controller.config import parse_config
from controller.errors import ConfigError
from controller.fleet import PAYLOAD_VERSION, FleetLink, MalformedPayload, Topics, decode, policy_from
from controller.validation import parse_policy_checked
from policies.spec import PolicyError, parse_policy, render_policy
from sim.trace import TraceError, read_trace, validate_trace

FUZZ = settings(max_examples=200, deadline=None)

POLICY_KEYS = ["apiVersion", "kind", "metadata", "name", "spec", "algorithm", "params", "arms", "rule",
               "decision_interval_s", "directive_ttl_s", "min_dwell_s", "contexts", "guards", "eagle3:2"]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=30)
    | st.sampled_from(
        ["static", "epsilon_greedy", "discounted_thompson", "nope", "eagle3:2", "ngram:9", "off"]
    )
)
documents = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(POLICY_KEYS) | st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=40,
)


def _one_line(e: Exception) -> None:
    assert str(e) and "\n" not in str(e).strip(), str(e)


def _valid_policy() -> dict[str, Any]:
    return {
        "apiVersion": "speccontrol/v1",
        "kind": "Policy",
        "metadata": {"name": "fuzz"},
        "spec": {"algorithm": {"name": "static", "params": {"arm": "eagle3:2"}}},
    }


@FUZZ
@given(st.text(max_size=2000))
def test_policy_text(text: str) -> None:
    try:
        parse_policy_checked(text, source="f.yaml")
    except PolicyError as e:
        assert str(e).startswith("f.yaml")


@FUZZ
@given(documents)
def test_policy_structures(doc: Any) -> None:
    try:
        text = yaml.safe_dump(doc)
    except (yaml.YAMLError, ValueError, OverflowError):
        return
    try:
        parse_policy_checked(text, source="f.yaml")
    except PolicyError as e:
        assert str(e).startswith("f.yaml")


#: Fields each place knows: replacing one of them (not only an unknown key) is what can be accepted.
KNOWN_KEYS = {
    "spec": ["decision_interval_s", "directive_ttl_s", "min_dwell_s", "seed", "switch_margin", "arms"],
    "spec.algorithm": ["params", "name"],
    "spec.algorithm.params": ["arm"],
    "metadata": ["name", "description", "labels"],
}


@FUZZ
@given(st.data(), st.sampled_from(sorted(KNOWN_KEYS)), documents | st.sampled_from(["eagle3:3", "x", 0.5, 7]))
def test_policy_with_one_field_replaced(data: st.DataObject, where: str, value: Any) -> None:
    """Start from a valid policy, put junk (wrong types, unknown algorithms, out-of-range values) or a
    valid value in one place; what is accepted renders back to the same spec."""
    key = data.draw(st.sampled_from(KNOWN_KEYS[where]) | st.text(max_size=12), label="key")
    doc = _valid_policy()
    node = doc
    for part in where.split("."):
        node = node[part]
    node[key or "name"] = value
    try:
        text = yaml.safe_dump(doc)
    except (yaml.YAMLError, ValueError, OverflowError):
        return
    try:
        spec = parse_policy_checked(text, source="f.yaml")
    except PolicyError as e:
        assert str(e).startswith("f.yaml")
        return
    event("accepted")
    again = parse_policy(render_policy(spec), source="rendered")
    assert again == spec


def test_policy_deep_nesting_and_huge_documents_are_refused_quickly() -> None:
    deep = "spec:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(200)) + "  " * 201 + "x: 1\n"
    flow = "spec: " + "[" * 5000 + "]" * 5000 + "\n"
    huge = "metadata: {name: x}\n" + "# pad\n" * 200_000
    bomb = (
        "a: &a ["
        + ",".join(["x"] * 100)
        + "]\n"
        + "".join(
            f"{c}: &{c} [" + ",".join([f"*{p}"] * 10) + "]\n"
            for p, c in zip("abcdefgh", "bcdefghi", strict=False)
        )
    )
    for text in (deep, flow, huge, bomb):
        try:
            parse_policy_checked(text, source="big.yaml")
        except PolicyError as e:
            _one_line(Exception(str(e).splitlines()[0]))
            assert str(e).startswith("big.yaml")
        else:
            raise AssertionError("accepted")


@FUZZ
@given(st.text(max_size=1000) | documents.map(lambda d: yaml.safe_dump(d) if True else ""))
def test_sidecar_config(text: str) -> None:
    try:
        parse_config(text, source="c.yaml")
    except ConfigError as e:  # anything else (a ValueError, a TypeError) fails the test
        assert str(e).startswith("c.yaml")
        _one_line(e)


envelopes = st.fixed_dictionaries(
    {},
    optional={
        "v": st.sampled_from([PAYLOAD_VERSION, 0, 2, "1", None]),
        "kind": st.sampled_from(["policy", "posteriors", "state", "x"]),
        "node": st.text(max_size=10) | st.integers(),
        "published_at": st.floats(allow_nan=True) | st.integers() | st.text(max_size=3),
        "version": st.integers(-5, 2**70) | st.booleans() | st.text(max_size=3),
        "yaml": st.text(max_size=200) | st.integers(),
        "source": st.text(max_size=10),
        "model": st.text(max_size=10),
        "state": documents,
    },
)


@FUZZ
@given(st.binary(max_size=3000) | envelopes.map(lambda d: json.dumps(d).encode()))
def test_mqtt_payloads_decode_or_are_malformed(raw: bytes) -> None:
    for kind in ("policy", "posteriors", "state"):
        try:
            doc = decode(kind, raw, limit=2048)
            if kind == "policy":
                policy_from(doc)
        except MalformedPayload as e:
            assert e.reason in ("too_large", "not_json", "schema", "version")
            _one_line(e)


def test_mqtt_payloads_through_the_fleet_link_are_counted() -> None:
    """Malformed messages reach the link's dispatch: counted by kind and reason, none of them fatal."""
    registry = CollectorRegistry()
    applied: list[int] = []
    link = FleetLink(
        broker=BrokerSettings.from_url("mqtt://127.0.0.1:1"),
        fleet="f",
        node_id="n",
        registry=registry,
        on_policy=lambda text, v: applied.append(v),
        max_payload_bytes=4096,
    )
    topics = Topics("f")

    @FUZZ
    @given(
        st.sampled_from([topics.policy, topics.posteriors("m"), topics.state("e")]), st.binary(max_size=5000)
    )
    def run(topic: str, raw: bytes) -> None:
        asyncio.run(link._dispatch(Received(topic, raw, False)))

    run()
    malformed = sum(
        s.value for m in registry.collect() if m.name == "speccontrol_fleet_malformed_messages"
        for s in m.samples if s.name.endswith("_total")
    )  # fmt: skip
    assert malformed > 0
    assert applied == []


trace_lines = st.lists(
    st.one_of(
        st.text(max_size=200),
        st.just('{"spectrace": 1, "max_k": 4, "methods": ["eagle3", "ngram"], "meta": {}}'),
        envelopes.map(json.dumps),
        st.builds(
            lambda n, acc: json.dumps({"id": "r", "prompt_tokens": 3, "output_tokens": n, "acc": acc}),
            st.integers(-3, 20) | st.integers(2**40, 2**41),
            st.dictionaries(
                st.sampled_from(["eagle3", "ngram", "x"]), st.lists(st.integers(-2, 70), max_size=20)
            ),
        ),
    ),
    max_size=8,
)


@FUZZ
@given(trace_lines, st.booleans())
def test_trace_files(lines: list[str], binary_junk: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.jsonl"
        data = "\n".join(lines).encode("utf-8", "surrogatepass")
        p.write_bytes(data + (b"\xff\xfe\x00" if binary_junk else b""))
        errors = validate_trace(p)
        for e in errors:
            assert isinstance(e, TraceError) and str(e)
        try:
            read_trace(p)
        except TraceError as e:
            assert str(e)
            assert errors, "read_trace refused what validate_trace accepted"


def test_parse_policy_itself_raises_only_policy_errors() -> None:
    """Found by the fuzzer (a TypeError from a list as the algorithm name); fixed in policies/spec.py."""
    doc = _valid_policy()
    doc["spec"]["algorithm"]["name"] = []
    with pytest.raises(PolicyError):
        parse_policy(yaml.safe_dump(doc), source="f.yaml")
