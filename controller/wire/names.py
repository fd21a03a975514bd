"""The names an engine gives the sidecar (its id, model, traffic classes): what the sidecar accepts,
written once for both ends, so an engine can check its own names before it says Hello. Pure.
"""

from __future__ import annotations

import re

#: The longest engine id the sidecar accepts in a Hello.
MAX_ENGINE_ID = 128
#: A sidecar's name in the fleet (``node_id``, the MQTT client id and the ``node`` of its payloads).
NODE_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

#: Control characters (C0, DEL, C1), Unicode line breaks and bidirectional controls: in
#: engine-supplied names the first two would forge log lines or break a metric label, the last
#: (embeddings, overrides, isolates, the marks) would show a log line or a terminal's table in an
#: order other than the bytes' ("Trojan Source", CVE-2021-42574).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def has_control(text: str) -> bool:
    return _CONTROL.search(text) is not None


def engine_id_problem(text: str) -> str | None:
    """Why ``text`` is no engine id the sidecar takes (None: it is one), naming it escaped and cut."""
    if text and len(text) <= MAX_ENGINE_ID and not has_control(text):
        return None
    shown = escape_text(text)
    shown = shown if len(shown) <= 80 else f"{shown[:77]}..."
    return (
        f"an engine id has 1-{MAX_ENGINE_ID} characters and no control characters, got '{shown}' "
        f"({len(text)} characters)"
    )


def escape_text(text: str) -> str:
    """``text`` with each control character written as an escape (``\\n``, ``\\x00``): safe in a
    log line or a label value."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
