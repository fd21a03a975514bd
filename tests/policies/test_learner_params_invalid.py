"""Invalid algorithm parameters in a policy document: one clear error naming file, line and field."""

import pytest

from policies.params import shown
from policies.spec import PolicyError, parse_policy


def doc(algorithm: str, params: str) -> str:
    return (
        "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: x}\nspec:\n"
        f"  algorithm:\n    name: {algorithm}\n    params: {params}\n"
    )


@pytest.mark.parametrize(
    ("algorithm", "params", "needle"),
    [
        ("batch_schedule", '{schedule: "1-16:x"}', "expected integers"),
        ("batch_schedule", '{schedule: "16-1:3"}', "LO <= HI"),
        ("batch_schedule", '{schedule: "1-16"}', "LO-HI:K"),
        # HI of 0 (the table's unbounded sentinel) and an empty HI were read as 'LO+' and 'LO-LO'
        ("batch_schedule", '{schedule: "1-0:5"}', "schedule entry '1-0:5': need 1 <= LO <= HI"),
        ("batch_schedule", '{schedule: "1-16:5,5-:3"}', "schedule entry '5-:3': expected integers"),
        ("batch_schedule", '{schedule: "-3:1"}', "schedule entry '-3:1': expected integers"),
        ("batch_schedule", "{method: medusa}", "medusa"),
        ("speculation_gate", '{arm: "eagle3"}', "method:k"),
        ("speculation_gate", "{threshold: 1.5}", "<= 1.0"),
        ("ucbspec", "{delta: 0}", ">= 1e-09"),
        ("exp3spec", "{eta_scale: -1}", ">= 0.01"),
        ("sw_ucb", "{window: 1}", ">= 2"),
        ("sw_ucb", "{window: 2.5}", "integer"),
        ("hedge", "{eta: .nan}", "finite"),
        # an integer beyond a double's range: float() raised OverflowError
        ("hedge", "{eta: 1" + "0" * 400 + "}", "must be finite, got an integer of 401 digits"),
        ("ngram_fallback", "{k: 0}", ">= 1"),
        ("thompson", "{discount: 0.9}", "unknown parameter"),
    ],
)
def test_bad_learner_params_fail_with_the_field(algorithm: str, params: str, needle: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(doc(algorithm, params), source="p.yaml")
    msg = str(e.value)
    assert msg.startswith("p.yaml:7: spec.algorithm.params"), msg
    assert needle in msg
    assert "\n" not in msg


def test_bad_rule_param_names_the_rule_field() -> None:
    text = doc("goodput_model", "{}") + "  rule: {kind: ngram_span, params: {min_run: 0}}\n"
    with pytest.raises(PolicyError, match=r"spec\.rule\.params\.min_run: must be >= 1"):
        parse_policy(text, source="p.yaml")


def test_a_value_too_long_to_quote_is_described_not_cut() -> None:
    # an integer cut at 60 digits read like 1e59; one message style for every edge check
    assert shown(10**59) == str(10**59)  # 60 digits: quoted whole
    assert shown(10**60) == "an integer of 61 digits"
    assert shown(-(10**400)) == "an integer of 401 digits"
    assert shown(True) == "True" and shown(1e308) == "1e+308" and shown(float("nan")) == "nan"
    assert shown("x" * 58) == repr("x" * 58)  # 60 characters with its quotes
    long = shown("x" * 59)
    assert len(long) == 60 and long.endswith("…")
    assert shown([1] * 100).endswith("…") and len(shown([1] * 100)) == 60
