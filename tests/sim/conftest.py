from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def write_lines(path: Path, header: dict[str, Any] | str, *rows: dict[str, Any] | str) -> Path:
    lines = [h if isinstance(h, str) else json.dumps(h) for h in (header, *rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


HEADER = {"spectrace": 1, "max_k": 4, "methods": ["eagle3", "ngram"], "meta": {"source": "hand-made"}}


@pytest.fixture
def hand_trace(tmp_path: Path) -> Path:
    """Two requests whose replay is worked out by hand in the tests."""
    return write_lines(
        tmp_path / "hand.jsonl",
        HEADER,
        {
            "id": "a",
            "class": "chat",
            "prompt_tokens": 10,
            "output_tokens": 6,
            "acc": {"eagle3": [2, 0, 3, 0, 0, 0], "ngram": [0, 0, 0, 0, 0, 0]},
        },
        {
            "id": "b",
            "class": "code",
            "prompt_tokens": 20,
            "output_tokens": 4,
            "acc": {"eagle3": [5, 5, 5, 5], "ngram": [3, 2, 1, 0]},
            "extra_field": "kept and ignored",
        },
    )
