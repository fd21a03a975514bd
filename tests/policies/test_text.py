"""policies.text: what counts as a control character in outside text, its escape, one-line messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.text import escape_text, has_control, one_line

BIDI = ["\u061c", "\u200e", "\u200f", "\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067",
        "\u2068", "\u2069"]  # fmt: skip


@pytest.mark.parametrize(
    "ch", ["\x00", "\n", "\r", "\x1b", "\x7f", "\x85", "\x9f", "\u2028", "\u2029", *BIDI]
)
def test_control_characters_and_line_breaks_are_found_and_escaped(ch: str) -> None:
    text = f"pod{ch}7"
    assert has_control(text)
    escaped = escape_text(text)
    assert not has_control(escaped) and escaped.startswith("pod") and escaped.endswith("7")


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Zl", "Zp"), blacklist_characters=BIDI)))
def test_printable_text_passes_unchanged(text: str) -> None:
    assert not has_control(text)
    assert escape_text(text) == text


@given(st.text())
def test_escaped_text_never_holds_a_control_character(text: str) -> None:
    assert not has_control(escape_text(text))


def test_a_bidirectional_override_cannot_reorder_a_log_line() -> None:
    # "pod-\u202eevil" shows as "pod-live" in a terminal; escaped, the bytes read as written.
    shown = escape_text("pod-\u202eevil")
    assert shown == "pod-\\u202eevil"
    assert escape_text("a\u2066b\u2069c") == "a\\u2066b\\u2069c"


def test_a_message_naming_a_file_with_a_newline_is_shown_whole_on_one_line() -> None:
    # The CLIs printed the first line only: "error: /tmp/bad" for /tmp/bad<newline>name.jsonl.
    assert one_line("/tmp/bad\nname.jsonl: line 1: not JSON\n") == "/tmp/bad\\nname.jsonl: line 1: not JSON"
    assert one_line("") == "error"


@given(st.text())
def test_one_line_keeps_every_printable_character_on_one_line(text: str) -> None:
    shown = one_line(text)
    assert not has_control(shown) and shown
    assert set(shown) >= {c for c in text.rstrip("\r\n") if not has_control(c)}
