import pytest

from policies.arms import OFF, Arm, Method


def test_parse_and_str_round_trip() -> None:
    for text in ("eagle3:3", "ngram:4", "p_eagle:7", "off"):
        assert str(Arm.parse(text)) == text
    assert Arm.parse("off:0") is OFF
    assert Arm.parse(" eagle3:2 ") == Arm(Method.EAGLE3, 2)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("eagle3", "expected 'method:k'"),
        ("medusa:2", "unknown method"),
        ("ngram:x", "integer"),
        ("ngram:0", "k >= 1"),
    ],
)
def test_parse_errors_say_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Arm.parse(text)


def test_off_has_k_zero() -> None:
    with pytest.raises(ValueError, match="k = 0"):
        Arm(Method.OFF, 2)
    assert not OFF.speculates and Arm.parse("ngram:1").speculates
