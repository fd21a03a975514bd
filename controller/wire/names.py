"""The names an engine gives the sidecar (its id, model, traffic classes): what the sidecar accepts,
written once for both ends, so an engine can check its own names before it says Hello. Pure.
What counts as a control character, and its escape, is ``policies.text``'s (re-exported here).
"""

from __future__ import annotations

from policies.text import escape_text, has_control

__all__ = ["MAX_ENGINE_ID", "engine_id_problem", "escape_text", "has_control"]

#: The longest engine id the sidecar accepts in a Hello.
MAX_ENGINE_ID = 128


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
