import pytest

from policies.arms import MAX_K, OFF, Arm, Method


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
        ("ngram:0", "k must be an integer 1..64"),
        # a K no engine drafts was taken, labelled as asked and played as the engine's max
        ("eagle3:65", "k must be an integer 1..64"),
        ("eagle3:1000000", "k must be an integer 1..64"),
        ("eagle3:99999999999999999999", "k must be an integer 1..64"),
        ("ngram:1_0", "k must be an integer 1..64"),  # int() reads it as 10
        ("ngram:+3", "k must be an integer 1..64"),
    ],
)
def test_parse_errors_say_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Arm.parse(text)


def test_k_is_bounded_in_the_constructor_too() -> None:
    assert Arm(Method.P_EAGLE, MAX_K).k == MAX_K == 64
    with pytest.raises(ValueError, match="k must be at most 64, got 65"):
        Arm(Method.EAGLE3, 65)


def test_off_has_k_zero() -> None:
    with pytest.raises(ValueError, match="k = 0"):
        Arm(Method.OFF, 2)
    assert not OFF.speculates and Arm.parse("ngram:1").speculates
