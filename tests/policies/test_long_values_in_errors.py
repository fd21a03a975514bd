"""Policy values of thousands of digits (YAML takes integers up to Python's 4,300-digit limit): the
error still names the file, line and field in a line of readable length.

What must hold: a parameter out of range quotes the value as written, shortened (``shown``: "an
integer of 4001 digits", ``1e+308`` for a float an integer parameter took), never the digits in full
(a 4,000-digit seed filled the terminal with them); a batch bucket bound names its index too.
"""

from __future__ import annotations

import pytest

from policies.spec import PolicyError, parse_policy

BASE = """\
apiVersion: speccontrol/v1
kind: Policy
metadata: {name: p}
spec:
  algorithm: {name: discounted_thompson, params: {discount: 0.9}}
"""
HUGE = "1" + "0" * 4000


@pytest.mark.parametrize(
    ("line", "field", "says"),
    [
        (f"  seed: {HUGE}", "spec.seed", "must be <= 4294967295, got an integer of 4001 digits"),
        ("  seed: 1e308", "spec.seed", "must be <= 4294967295, got 1e+308"),
        (f"  seed: -{HUGE}", "spec.seed", "must be >= 0, got an integer of 4001 digits"),
        (f"  slo: {{window: {HUGE}}}", "spec.slo.window", "got an integer of 4001 digits"),
        (
            f"  contexts: {{batch_buckets: [1, {HUGE}]}}",
            "spec.contexts.batch_buckets",
            "bounds[1] must be an integer 1..1048576, got an integer of 4001 digits",
        ),
    ],
)
def test_a_huge_value_is_named_in_a_short_line(line: str, field: str, says: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(BASE + line + "\n", source="p.yaml")
    assert (e.value.line, e.value.field) == (6, field)
    assert says in e.value.message
    assert len(str(e.value)) < 200
