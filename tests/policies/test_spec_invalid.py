"""Invalid policy documents: every error names the file, the line and the field."""

import pytest

from policies.spec import MAX_DOCUMENT_BYTES, PolicyError, parse_policy

GOOD = """\
apiVersion: speccontrol/v1
kind: Policy
metadata:
  name: p
spec:
  algorithm:
    name: discounted_thompson
    params:
      discount: 0.9
  arms: [eagle3:3, ngram:4, off]
  min_dwell_s: 2
  rule:
    kind: ngram_margin
    params: {margin: 0.5}
"""


def broken(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


@pytest.mark.parametrize(
    ("text", "line", "field", "needle"),
    [
        (broken("discount: 0.9", "discount: 1.5"), 9, "spec.algorithm.params.discount", "<= 1.0"),
        (broken("discount: 0.9", "discount: fast"), 9, "spec.algorithm.params.discount", "expected a number"),
        (broken("discount: 0.9", "dicsount: 0.9"), 9, "spec.algorithm.params.dicsount", "unknown parameter"),
        (broken("name: discounted_thompson", "name: magic"), 7, "spec.algorithm.name", "unknown algorithm"),
        (broken("ngram:4, off", "ngram:4, medusa:2"), 10, "spec.arms[2]", "unknown method"),
        (broken("ngram:4, off", "ngram:4, ngram:4"), 10, "spec.arms[2]", "duplicate"),
        (broken("min_dwell_s: 2", "min_dwell_s: -1"), 11, "spec.min_dwell_s", ">= 0.0"),
        (broken("min_dwell_s: 2", "min_dwel_s: 2"), 11, "spec.min_dwel_s", "unknown field"),
        (broken("kind: ngram_margin", "kind: sometimes"), 13, "spec.rule.kind", "unknown rule"),
        (broken("margin: 0.5", "margin: -3"), 14, "spec.rule.params.margin", ">= 0.0"),
        (broken("kind: Policy", "kind: Poliyc"), 2, "kind", "must be 'Policy'"),
        (broken("speccontrol/v1", "speccontrol/v2"), 1, "apiVersion", "must be"),
        (broken("name: p", "name: 'bad name!'"), 4, "metadata.name", "got 'bad name!'"),
    ],
)
def test_error_names_line_and_field(text: str, line: int, field: str, needle: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(text, source="p.yaml")
    assert (e.value.source, e.value.line, e.value.field) == ("p.yaml", line, field)
    assert needle in e.value.message
    assert str(e.value).startswith(f"p.yaml:{line}: {field}: ")


def test_yaml_syntax_error_has_a_line() -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(
            broken("  arms: [eagle3:3, ngram:4, off]", "  arms: [eagle3:3, ngram:4"), source="p.yaml"
        )
    assert e.value.line is not None and "invalid YAML" in str(e.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty document"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: x}\n", "spec: expected a mapping"),
        ("a: " + "[" * 40 + "]" * 40, "nested deeper"),
        ("x: " + "y" * (MAX_DOCUMENT_BYTES + 1), "larger than"),
        ("!!python/object:os.system {}", "invalid YAML"),
        ("a: &x [1]\nb: *x\n", "unknown field"),
        ("a: " + "[" * 20_000 + "]" * 20_000, "nested too deeply"),  # beyond the parser's recursion
        (
            "a: 1" + "0" * 5000,
            "1: a: an integer longer than 4300 digits",
        ),  # int() of > 4,300 digits: its line and key
    ],
)
def test_malformed_documents(text: str, needle: str) -> None:
    with pytest.raises(PolicyError, match=needle):
        parse_policy(text, source="p.yaml")


def test_static_needs_a_valid_arm() -> None:
    text = broken(
        "name: discounted_thompson\n    params:\n      discount: 0.9",
        "name: static\n    params:\n      arm: eagle3",
    )
    with pytest.raises(PolicyError) as e:
        parse_policy(text, source="p.yaml")
    assert e.value.field == "spec.algorithm.params.arm" and e.value.line == 9


SAFE = (
    GOOD
    + """\
  switch_margin: 0.02
  drift: {detector: page_hinkley, threshold: 30}
  slo:
    p99_tpot_ms: 50
  exploration: {max_share_at_high_load: 0.05, high_load_batch: 32}
"""
)


def test_safety_sections_parse() -> None:
    s = parse_policy(SAFE, source="p.yaml")
    assert s.switch_margin == 0.02
    assert s.drift["detector"] == "page_hinkley" and s.drift["threshold"] == 30.0 and s.drift["delta"] == 0.05
    assert s.slo["p99_tpot_ms"] == 50.0 and s.slo["window"] == 512
    assert s.exploration == {"max_share_at_high_load": 0.05, "high_load_batch": 32}


@pytest.mark.parametrize(
    ("old", "new", "line", "field", "needle"),
    [
        ("switch_margin: 0.02", "switch_margin: -0.1", 15, "spec.switch_margin", ">= 0.0"),
        ("detector: page_hinkley", "detector: cusum", 16, "spec.drift.detector", "unknown detector"),
        ("threshold: 30", "threshold: 0", 16, "spec.drift.threshold", ">= 0.1"),
        ("threshold: 30", "treshold: 30", 16, "spec.drift.treshold", "unknown parameter"),
        ("p99_tpot_ms: 50", "p99_tpot_ms: fast", 18, "spec.slo.p99_tpot_ms", "expected a number"),
        ("high_load_batch: 32", "high_load_batch: 0.5", 19, "spec.exploration.high_load_batch", "integer"),
        (
            "max_share_at_high_load: 0.05",
            "max_share_at_high_load: 2",
            19,
            "spec.exploration.max_share_at_high_load",
            "<= 1.0",
        ),
        ("  slo:\n    p99_tpot_ms: 50", "  slo: [50]", 17, "spec.slo", "expected a mapping"),
        # A guard that needs more samples than its window keeps would never act.
        (
            "p99_tpot_ms: 50",
            "p99_tpot_ms: 50\n    window: 100\n    min_samples: 101",
            20,
            "spec.slo.min_samples",
            "must be at most spec.slo.window (100), got 101",
        ),
        (  # the default min_samples (64) against a smaller window: the error points at the section
            "p99_tpot_ms: 50",
            "p99_tpot_ms: 50\n    window: 32",
            18,
            "spec.slo.min_samples",
            "must be at most spec.slo.window (32), got 64",
        ),
    ],
)
def test_safety_section_errors_name_line_and_field(
    old: str, new: str, line: int, field: str, needle: str
) -> None:
    assert old in SAFE
    with pytest.raises(PolicyError) as e:
        parse_policy(SAFE.replace(old, new), source="p.yaml")
    assert (e.value.line, e.value.field) == (line, field)
    assert needle in e.value.message


def test_slo_min_samples_equal_to_the_window_is_accepted() -> None:
    s = parse_policy(
        SAFE.replace("p99_tpot_ms: 50", "p99_tpot_ms: 50\n    window: 100\n    min_samples: 100")
    )
    assert (s.slo["window"], s.slo["min_samples"]) == (100, 100)


def test_alias_bombs_are_refused_not_walked() -> None:
    # Nine levels of nine aliases each: under 1 KiB of text, 9**9 nodes if expanded.
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    with pytest.raises(PolicyError, match="expands to more than"):
        parse_policy("\n".join(lines) + "\n", source="bomb.yaml")


def test_a_non_string_algorithm_name_is_a_policy_error() -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(broken("name: discounted_thompson", "name: []"), source="p.yaml")
    assert e.value.field == "spec.algorithm.name" and e.value.line == 7


@pytest.mark.parametrize(
    ("text", "where"),
    [
        # PyYAML keeps the last of two equal keys: the first spec (or value) would be dropped unread
        (
            "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: dup}\n"
            "spec:\n  algorithm: {name: static, params: {arm: 'eagle3:2'}}\nspec:\n  algorithm: {name: ucb1}\n",
            "p.yaml:6: spec: duplicate key (first on line 4",
        ),
        (
            "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: dup}\nspec:\n"
            "  algorithm: {name: ucb1}\n  directive_ttl_s: 10\n  directive_ttl_s: 0.1\n",
            "p.yaml:7: spec.directive_ttl_s: duplicate key (first on line 6",
        ),
        (
            "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: a, name: b}\nspec: {algorithm: {name: ucb1}}\n",
            "p.yaml:3: metadata.name: duplicate key (first on line 3",
        ),
    ],
)
def test_a_key_given_twice_is_refused_at_its_second_line(text: str, where: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(text, source="p.yaml")
    assert str(e.value).startswith(where), str(e.value)


@pytest.mark.parametrize("name", ["pólicy", "dеfault", "名前"])
def test_names_an_earlier_version_took_are_refused_new_and_restored_saved(name: str) -> None:
    # Before 2026-12-06 any Unicode letter or digit passed: a snapshot holding such a policy
    # is restored (an upgrade discards nothing); a new document is held to the one name rule.
    text = broken("name: p", f"name: '{name}'")
    with pytest.raises(PolicyError, match=r"^p\.yaml:4: metadata\.name: must be 1-128 letters"):
        parse_policy(text, source="p.yaml")
    assert parse_policy(text, source="p.yaml", saved=True).name == name


def test_a_saved_policy_still_needs_a_name() -> None:
    with pytest.raises(PolicyError, match=r"metadata\.name: must be"):
        parse_policy(broken("name: p", "name: 'bad name!'"), source="p.yaml", saved=True)
