"""policies.text: what counts as a control character in outside text, its escape, one-line messages."""

from __future__ import annotations

import gzip
import ssl
import urllib.error

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.text import error_text, escape_text, has_control, name_problem, one_line

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


NAME_CHARS = "abcXYZ019-_."


@given(st.text(alphabet=NAME_CHARS, min_size=1, max_size=128).filter(lambda s: s not in (".", "..")))
def test_names_of_the_allowed_characters_pass(name: str) -> None:
    assert name_problem(name) is None


@given(st.text(max_size=140))
def test_a_name_passes_exactly_when_it_is_ascii_name_characters(name: str) -> None:
    allowed = 0 < len(name) <= 128 and name.isascii() and all(c.isalnum() or c in "-_." for c in name)
    assert (name_problem(name) is None) == (allowed and name not in (".", ".."))


@pytest.mark.parametrize(
    "name", ["", ".", "..", "a/b", "a b", "pólicy", "dеfault", "x" * 129, None, 7, ["p"]]
)
def test_bad_names_are_refused_naming_the_rule_and_the_value(name: object) -> None:
    # "dеfault" holds a Cyrillic "е": it would show as the preset "default" in a list of policies.
    problem = name_problem(name)
    assert problem is not None and problem.startswith("must be 1-128 letters, digits, '-', '_' or '.'")
    assert problem.endswith(repr(name)[:40]) or "…" in problem


def test_the_longest_name_is_the_callers() -> None:
    assert name_problem("f" * 64, longest=64) is None
    problem = name_problem("f" * 65, longest=64)
    assert problem is not None and problem.startswith("must be 1-64 letters") and problem.endswith("ff…")


def _ssl_error() -> ssl.SSLError:
    e = ssl.SSLError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    e.reason = "CERTIFICATE_VERIFY_FAILED"  # (as the ssl module sets it)
    return e


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (FileNotFoundError(2, "No such file or directory", "/x"), "No such file or directory"),
        (urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")), "Connection refused"),
        (urllib.error.URLError("no connection within 0.3 s"), "no connection within 0.3 s"),
        (gzip.BadGzipFile("Not a gzipped file (b'xx')"), "Not a gzipped file (b'xx')"),  # no strerror
        (EOFError("Compressed file ended before the end-of-stream marker was reached"),
         "Compressed file ended before the end-of-stream marker was reached"),
        (ValueError("bad"), "bad"),
        (_ssl_error(), "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),  # not its reason
    ],
)  # fmt: skip
def test_an_error_is_said_in_its_own_words(error: BaseException, says: str) -> None:
    # (str() gave "[Errno 2] No such file or directory: '/x'", "<urlopen error [Errno 111] ...>")
    assert error_text(error) == says
