from pathlib import Path

import pytest

from policies.arms import Arm
from policies.spec import parse_policy, render_policy, static_policy

LIBRARY = Path(__file__).resolve().parents[2] / "policies" / "library"


@pytest.mark.parametrize("path", sorted(LIBRARY.glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_parses_and_is_named_after_its_file(path: Path) -> None:
    spec = parse_policy(path.read_text(), source=str(path))
    assert spec.name == path.stem


def test_default_preset_values() -> None:
    spec = parse_policy((LIBRARY / "default.yaml").read_text())
    assert spec.algorithm == "goodput_model"
    assert spec.params["memory_steps"] == 2000
    assert spec.rule.kind == "ngram_span" and spec.rule.params["min_run"] == 2
    assert spec.buckets.labels()[-1] == "33+"


def test_defaults_fill_missing_fields() -> None:
    spec = parse_policy(
        "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: x}\nspec:\n  algorithm: {name: epsilon_greedy}\n"
    )
    assert spec.params == {"epsilon": 0.1, "discount": 1.0}
    assert spec.arms == () and spec.decision_interval_s == 1.0 and spec.rule.kind == "none"


def test_render_round_trips() -> None:
    spec = parse_policy((LIBRARY / "default.yaml").read_text())
    again = parse_policy(render_policy(spec))
    assert again == spec


def test_static_policy_helper() -> None:
    spec = static_policy("ngram:4")
    assert spec.name == "static-ngram-4" and spec.params["arm"] == "ngram:4"
    assert static_policy(Arm.parse("off")).name == "static-off"


def test_spec_is_immutable() -> None:
    spec = static_policy("off")
    with pytest.raises(AttributeError):
        spec.name = "y"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.params["arm"] = "eagle3:1"  # type: ignore[index]


def test_bare_off_is_the_off_arm() -> None:
    # YAML 1.1 reads `off` as a boolean; the parser takes it as the arm users mean.
    spec = parse_policy(
        "apiVersion: speccontrol/v1\nkind: Policy\nmetadata: {name: x}\n"
        "spec:\n  algorithm: {name: static, params: {arm: off}}\n  arms: [eagle3:2, off]\n"
    )
    assert spec.params["arm"] == "off" and spec.arms[1] == Arm.parse("off")
