"""A trace whose file name is not UTF-8 (bytes a file system takes, as ``s\\xff.jsonl``).

What must hold: the trace's name, which the result JSON, the report and a sweep's directories carry, is
text: the name's other bytes written as escapes (``s\\xff``), as the importer writes ``source_file``.
``sim replay --json`` wrote ``"trace": "s\\udcff"`` (a lone surrogate, no UTF-8 text) and ``--out`` ran
the whole replay, then exited 1 with nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from sim.cli import main
from sim.trace import read_trace

NAME = os.fsdecode(b"s\xff.jsonl")


def _renamed(hand_trace: Path, tmp_path: Path) -> Path:
    p = tmp_path / NAME
    shutil.copyfile(hand_trace, p)
    return p


def test_the_name_is_text(hand_trace: Path, tmp_path: Path) -> None:
    name = read_trace(_renamed(hand_trace, tmp_path)).name
    assert name == "s\\xff"
    name.encode("utf-8")  # raised UnicodeEncodeError: surrogates not allowed


def test_replay_json_is_utf8(hand_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["sim", "replay", "--trace", str(_renamed(hand_trace, tmp_path)), "--policy", "default"]
    assert main([*argv, "--concurrency", "1", "--no-oracle", "--json", str(out)]) == 0
    assert json.loads(out.read_bytes().decode("utf-8"))["trace"] == "s\\xff"  # was "s\udcff"


def test_replay_out_writes_the_report(hand_trace: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    argv = ["sim", "replay", "--trace", str(_renamed(hand_trace, tmp_path)), "--policy", "default"]
    # exit 1 after the run: "--out ...: a name in the report is not valid Unicode text"
    assert main([*argv, "--concurrency", "1", "--no-oracle", "--out", str(out)]) == 0
    assert "s\\xff" in (out / "report.md").read_text(encoding="utf-8")
