from __future__ import annotations

import io

from sim.progress import ProgressBar


def test_progress_bar_draws_plain_text() -> None:
    s = io.StringIO()
    bar = ProgressBar(total=10, label="replay", stream=s, enabled=True, interval_s=0.0, width=10)
    bar.advance(5)
    bar.close()
    text = s.getvalue()
    assert "[#####.....]  50.0%" in text and "replay" in text and text.endswith("\n")
    assert "\x1b" not in text


def test_progress_bar_silent_when_disabled() -> None:
    s = io.StringIO()
    bar = ProgressBar(total=10, stream=s, enabled=False)
    bar.advance(10)
    bar.close()
    assert s.getvalue() == ""
