"""The names an engine gives the sidecar (its id, model, traffic classes): what the sidecar accepts,
written once for both ends, so an engine can check its own names before it says Hello. Pure.
What counts as a control character, and its escape, is ``policies.text``'s (re-exported here).
"""

from __future__ import annotations

from policies.text import escape_text, has_control

__all__ = [
    "MAX_ENGINE_ID",
    "MAX_TRAFFIC_CLASS",
    "engine_id_problem",
    "escape_text",
    "has_control",
    "traffic_class_name",
]

#: The longest engine id the sidecar accepts in a Hello.
MAX_ENGINE_ID = 128
#: The longest traffic class name the sidecar accepts in a report (a longer one, or one holding a
#: control character, refuses the whole batch).
MAX_TRAFFIC_CLASS = 64


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


def traffic_class_name(label: str) -> str:
    """A request's traffic class label (its client's text) as an engine reports it: a name the sidecar
    accepts, whatever the client wrote. Control characters are escaped (``escape_text``), so are the
    characters UTF-8 cannot carry (a lone surrogate: JSON's "\\ud800" decodes to one, and protobuf
    cannot encode it), and the result is cut to ``MAX_TRAFFIC_CLASS``. Reported as written, one such
    label got every batch holding a step of its request refused, or failed the batch's encoding."""
    # Cut first too (escapes only lengthen, one character at a time): a megabyte label costs no more.
    cut = label[:MAX_TRAFFIC_CLASS]
    return escape_text(cut).encode("utf-8", "backslashreplace").decode("utf-8")[:MAX_TRAFFIC_CLASS]
