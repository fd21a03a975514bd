"""controller.wire.names: what counts as a control character in an engine's names, and its escape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.wire.names import escape_text, has_control


@pytest.mark.parametrize("ch", ["\x00", "\n", "\r", "\x1b", "\x7f", "\x85", "\x9f", "\u2028", "\u2029"])
def test_control_characters_and_line_breaks_are_found_and_escaped(ch: str) -> None:
    text = f"pod{ch}7"
    assert has_control(text)
    escaped = escape_text(text)
    assert not has_control(escaped) and escaped.startswith("pod") and escaped.endswith("7")


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Zl", "Zp"))))
def test_printable_text_passes_unchanged(text: str) -> None:
    assert not has_control(text)
    assert escape_text(text) == text


@given(st.text())
def test_escaped_text_never_holds_a_control_character(text: str) -> None:
    assert not has_control(escape_text(text))
