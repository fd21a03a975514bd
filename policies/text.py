"""Text from outside (engine names, file names, error messages that quote them) made safe to print
on one line, and the one rule for the names the product's parts are given. Pure.

What must hold: ``escape_text`` leaves no character that ``has_control`` finds, changes nothing in
text without one, and keeps every other character (a message is shown whole, never cut).
``name_problem`` accepts exactly 1..``longest`` of ASCII letters, digits, '-', '_' and '.', other than
'.' and '..'.
"""

from __future__ import annotations

import re

from policies.params import shown

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


def error_text(e: BaseException) -> str:
    """What an error says, in its own words: the ``reason`` a wrapper holds (urllib's "<urlopen error
    [Errno 111] Connection refused>") and an OSError's number and file name ("[Errno 2] No such file or
    directory: 'x'", where the caller names the file) taken off: "Connection refused". An error's own
    strerror comes first: ssl.SSLError's ``reason`` is a bare code ("CERTIFICATE_VERIFY_FAILED")."""
    if isinstance(e, OSError) and e.strerror:
        return str(e.strerror)
    inner = getattr(e, "reason", None)
    what = inner if inner is not None else e
    if isinstance(what, OSError) and what.strerror:
        return str(what.strerror)
    return str(what)


#: Names of policies, cost-model profiles, fleets and sidecars (``node_id``): they become metric
#: label values, MQTT topic levels, MQTT client ids and (profiles) file names, so they are ASCII (a
#: look-alike letter cannot pass for a preset's name) and never '.' or '..' (a directory).
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def name_problem(name: object, *, longest: int = 128) -> str | None:
    """What is wrong with ``name`` as such a name (None: nothing), in the words every reader uses."""
    if isinstance(name, str) and len(name) <= longest and _NAME.fullmatch(name) and name not in (".", ".."):
        return None
    return f"must be 1-{longest} letters, digits, '-', '_' or '.' (not '.' or '..'), got {shown(name)}"
