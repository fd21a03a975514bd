"""The names an engine gives the sidecar (its id, model, traffic classes, request ids): what the sidecar
accepts, written once for both ends, so an engine can check its own names before it says Hello, and
report its clients' text (a request's class label, its id) as names the sidecar takes. Pure.
What counts as a control character, and its escape, is ``policies.text``'s (re-exported here).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from policies.text import escape_text, has_control

__all__ = [
    "MAX_ENGINE_ID",
    "MAX_PLUGIN_MODE",
    "MAX_REQUEST_ID",
    "MAX_TRAFFIC_CLASS",
    "engine_id_problem",
    "escape_text",
    "has_control",
    "request_ids_for_wire",
    "traffic_class_name",
]

#: The longest engine id the sidecar accepts in a Hello.
MAX_ENGINE_ID = 128
#: Hello.plugin_mode is a short sentence ("K table only: <reason>"); the sidecar refuses a longer one.
MAX_PLUGIN_MODE = 512
#: The longest traffic class name the sidecar accepts in a report (a longer one, or one holding a
#: control character, refuses the whole batch).
MAX_TRAFFIC_CLASS = 64
#: The longest request id the sidecar accepts in a report (a longer one refuses the whole batch).
MAX_REQUEST_ID = 256


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
    return _utf8(escape_text(label[:MAX_TRAFFIC_CLASS]))[:MAX_TRAFFIC_CLASS]


def request_ids_for_wire(ids: Sequence[str]) -> Sequence[str]:
    """A step's request ids as an engine reports them: ``ids`` itself when the sidecar takes them all
    (the usual step: one pass over them), else each one it would refuse made one it takes. vLLM's
    request ids carry the client's own (a request's ``request_id``, the X-Request-Id header): one
    longer than ``MAX_REQUEST_ID`` got every batch holding a step of its request refused, one holding
    a lone surrogate failed the batch's encoding. Such an id becomes its first characters (those
    UTF-8 cannot carry escaped) and a hash of the whole, so each request keeps an id of its own."""
    # (joined: one ASCII test in C, where a test per id cost the sender about 40 µs at 512 requests)
    if max(map(len, ids), default=0) <= MAX_REQUEST_ID and "".join(ids).isascii():
        return ids
    return [_request_id(rid) for rid in ids]


def _request_id(rid: str) -> str:
    safe = _utf8(rid[: MAX_REQUEST_ID + 1])
    if len(safe) <= MAX_REQUEST_ID and len(rid) <= MAX_REQUEST_ID:
        return safe
    digest = hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{safe[: MAX_REQUEST_ID - len(digest) - 1]}~{digest}"


def _utf8(text: str) -> str:
    """``text`` with each character UTF-8 cannot carry (a lone surrogate) written as its escape."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")
