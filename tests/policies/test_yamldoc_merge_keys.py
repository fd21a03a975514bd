"""YAML merge keys (``<<: [*a, *b]``) in policy documents and the sidecar's config (policies.yamldoc).

What must hold: a key that two mappings of one merge sequence both give is refused, naming the line and
the field (YAML takes the first mapping's value; PyYAML 6 took the last for any key longer than one
character, so the document read other than it says); a key beside the merge key overrides the merged
ones and is taken (also where two merged mappings give it), as are merges whose mappings give
different keys; a saved document (a snapshot's, accepted by an earlier version) is read as before,
never refused on restore.
"""

from __future__ import annotations

import pytest

from policies import yamldoc
from policies.spec import PolicyError, parse_policy

LIMITS = {"max_depth": 12, "max_nodes": 20_000}

#: Two parameter sets kept in the labels and merged into the algorithm's params: both give `discount`.
TWO_SETS = """\
apiVersion: speccontrol/v1
kind: Policy
metadata:
  name: p
  labels:
    fast: &fast {discount: 0.5}
    safe: &safe {discount: 0.99}
spec:
  algorithm:
    name: discounted_thompson
    params:
      <<: [*fast, *safe]
"""


def test_a_key_two_merged_mappings_give_is_refused_at_its_line_and_field() -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(TWO_SETS, source="p.yaml")
    assert (e.value.line, e.value.field) == (7, "spec.algorithm.params.discount")
    assert "merged on line 12 (lines 6 and 7)" in e.value.message


def test_in_one_line_flow_mappings_too() -> None:
    text = (
        "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {<<: [{name: p1}, {name: p2}]}\n"
        "spec: {algorithm: {name: static, params: {arm: 'off'}}}\n"
    )
    with pytest.raises(PolicyError) as e:
        parse_policy(text)
    assert (e.value.line, e.value.field) == (3, "metadata.name")


def test_a_key_beside_the_merge_key_overrides_and_disjoint_merges_are_taken() -> None:
    # both merged sets give discount, the mapping's own value decides: nothing is ambiguous
    spec = parse_policy(TWO_SETS.replace("<<: [*fast, *safe]", "<<: [*fast, *safe]\n      discount: 0.7"))
    assert spec.params["discount"] == 0.7
    spec = parse_policy(
        TWO_SETS.replace("{discount: 0.99}", "{prior_weight: 2.0}").replace(
            "<<: [*fast, *safe]", "<<: [*fast, *safe]\n      discount: 0.8"
        )
    )
    assert (spec.params["discount"], spec.params["prior_weight"]) == (0.8, 2.0)
    spec = parse_policy(TWO_SETS.replace("{discount: 0.99}", "{prior_weight: 2.0}"))
    assert (spec.params["discount"], spec.params["prior_weight"]) == (0.5, 2.0)


@pytest.mark.parametrize(
    ("text", "line", "path"),
    [
        # the same anchor twice: each key twice
        ("a: &a {kk: 1}\nb: {<<: [*a, *a]}\n", 1, "b.kk"),
        # a merged mapping that itself merges: its merged keys count as its own
        ("a: &a {kk: 1}\nb: &b {<<: *a}\nc: &c {kk: 2}\nd: {<<: [*b, *c]}\n", 3, "d.kk"),
        # in a list, deeper down
        ("l:\n- x: &x {kk: 1, jj: 2}\n- y: &y {jj: 3}\n- {<<: [*x, *y]}\n", 3, "l[2].jj"),
    ],
)
def test_nested_and_repeated_merges_are_refused(text: str, line: int, path: str) -> None:
    with pytest.raises(yamldoc.YamlProblem) as e:
        yamldoc.load(text, **LIMITS)
    assert (e.value.line, e.value.path) == (line, path)


def test_a_saved_document_is_read_as_before() -> None:
    # What an earlier version accepted and saved restores: the rule applies to new documents only.
    spec = parse_policy(TWO_SETS, source="<snapshot>", saved=True)
    assert spec.algorithm == "discounted_thompson"
    data, _ = yamldoc.load("a: &a {kk: 1}\nb: {<<: [*a, *a]}\n", saved=True, **LIMITS)
    assert data["b"] == {"kk": 1}


def test_a_mapping_merging_itself_is_not_walked_forever() -> None:
    # an alias to the anchor of the mapping being composed: PyYAML builds a cycle
    with pytest.raises(yamldoc.YamlProblem):
        yamldoc.load("a: &a {kk: 1, <<: [*a, *a]}\n", **LIMITS)
