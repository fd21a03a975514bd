"""A line giving both ``class`` and ``traffic_class`` to ``trace import`` (token ids or vLLM responses).

What must hold: both keys with different values are refused as ``FILE:LINE: class: ...`` naming both
(``traffic_class`` won: the line's ``class`` was dropped unread), exit 2, nothing written; a null key
counts as absent, so the other key's class is taken (a null ``traffic_class`` put the request in
``default`` whatever its ``class`` said); both alike, or either alone, import as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sim.cli import main
from sim.importer import import_token_ids, import_vllm_metrics
from sim.trace import TraceError

TOKENS = {"prompt_token_ids": [1, 2, 3, 4], "output_token_ids": [1, 2, 3, 4, 5]}
RESPONSE = {
    "usage": {"prompt_tokens": 4, "completion_tokens": 5},
    "metrics": {"speculative_decoding": {"per_step_accepted": [2, 1], "per_step_drafted": [2, 2]}},
}


def _write(path: Path, *rows: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("base", [TOKENS, RESPONSE], ids=["tokens", "vllm"])
@pytest.mark.parametrize(
    ("classes", "says"),
    [
        ({"class": "code", "traffic_class": "chat"}, "'code', but traffic_class is 'chat'"),
        ({"class": "", "traffic_class": "chat"}, "'', but traffic_class is 'chat'"),
    ],
)
def test_two_different_classes_are_refused_naming_both(
    tmp_path: Path, base: dict[str, Any], classes: dict[str, Any], says: str
) -> None:
    src = _write(tmp_path / "in.jsonl", {**base, "id": "a"}, {**base, "id": "b", **classes})
    load = import_token_ids if base is TOKENS else import_vllm_metrics
    with pytest.raises(TraceError) as e:
        load(src)
    assert (e.value.line, e.value.field) == (2, "class")
    assert e.value.message == f"{says}: give one of them"


def test_the_cli_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write(tmp_path / "in.jsonl", {**TOKENS, "class": "code", "traffic_class": "chat"})
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", "--tokens", str(src), "--out", str(out)]) == 2
    assert (
        capsys.readouterr().err == f"{src}:1: class: 'code', but traffic_class is 'chat': give one of them\n"
    )
    assert not out.exists()


@pytest.mark.parametrize("base", [TOKENS, RESPONSE], ids=["tokens", "vllm"])
def test_one_key_or_both_alike_import_as_before(tmp_path: Path, base: dict[str, Any]) -> None:
    src = _write(
        tmp_path / "in.jsonl",
        {**base, "id": "a", "class": "code", "traffic_class": "code"},
        {**base, "id": "b", "traffic_class": "chat"},
        {**base, "id": "c", "class": "edit"},
        {**base, "id": "d", "class": None},
        {**base, "id": "e", "class": "code", "traffic_class": None},
        {**base, "id": "f", "class": None, "traffic_class": "chat"},
    )
    load = import_token_ids if base is TOKENS else import_vllm_metrics
    assert load(src).classes == ("code", "chat", "edit", "default", "code", "chat")
