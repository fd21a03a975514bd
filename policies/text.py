"""Text from outside (engine names, file names, error messages that quote them) made safe to print
on one line. Pure.

What must hold: ``escape_text`` leaves no character that ``has_control`` finds, changes nothing in
text without one, and keeps every other character (a message is shown whole, never cut).
"""

from __future__ import annotations

import re

#: Control characters (C0, DEL, C1), Unicode line breaks and bidirectional controls: in
#: engine-supplied names the first two would forge log lines or break a metric label, the last
#: (embeddings, overrides, isolates, the marks) would show a log line or a terminal's table in an
#: order other than the bytes' ("Trojan Source", CVE-2021-42574).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def has_control(text: str) -> bool:
    return _CONTROL.search(text) is not None


def escape_text(text: str) -> str:
    """``text`` with each control character written as an escape (``\\n``, ``\\x00``): safe in a
    log line or a label value."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def one_line(message: str) -> str:
    """An error message as one line, whole: a file name holding a newline is shown escaped, not cut
    at the newline (trailing line breaks are dropped)."""
    return escape_text(message.rstrip("\r\n")) or "error"
