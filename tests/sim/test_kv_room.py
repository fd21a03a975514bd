"""A trace whose longest request does not fit the KV cache its profile leaves room for.

What must hold: ``sim replay|compare|tune`` refuse it before any replay, in one line naming the
profile, the room and the request (exit 2, nothing written): vLLM cannot hold such a request at all
(it would not start with a context that long), and the replay had priced it as if it fitted (a profile
with room for 0 KV tokens replayed 32 requests of a thousand-token prompt at 2,451 tok/s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sim.cli import main
from sim.costmodel import _profile_dir

QUICK = ["--concurrency", "4"]


def _profile(tmp_path: Path, weights_gb: float) -> Path:
    doc = yaml.safe_load((_profile_dir() / "llama-3.1-8b-h100.yaml").read_text(encoding="utf-8"))
    doc["name"] = "small-kv"
    doc["memory"]["weights_gb"] = weights_gb  # usable 72 GB - draft 0.8 - reserve 4 = 67.2 GB + room
    p = tmp_path / "small-kv.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def _trace(tmp_path: Path, prompt: int) -> Path:
    p = tmp_path / "t.jsonl"
    rows = [
        {"id": f"r{i}", "class": "chat", "prompt_tokens": prompt, "output_tokens": 3,
         "acc": {"eagle3": [1, 0, 2], "ngram": [0, 0, 0]}}
        for i in range(3)
    ]  # fmt: skip
    header = {"spectrace": 1, "max_k": 4, "methods": ["eagle3", "ngram"]}
    p.write_text("".join(json.dumps(r) + "\n" for r in (header, *rows)))
    return p


@pytest.mark.parametrize(
    "command",
    [
        ["sim", "replay", "--policy", "default", "--no-oracle"],
        ["sim", "compare", "--policy", "default", "--no-oracle"],
        ["sim", "tune", "--policy", "epsilon-greedy", "--param", "epsilon=0,0.2"],
    ],
)
@pytest.mark.parametrize(("weights_gb", "room"), [(67.1999, 0), (67.19, 76)])
def test_a_request_longer_than_the_kv_room_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str], weights_gb: float, room: int
) -> None:
    # 1e-4 GB of room at 131,072 bytes a token is no token; 0.01 GB is 76.
    out = tmp_path / "out.json"
    prof = _profile(tmp_path, weights_gb)
    argv = [*command, "--trace", str(_trace(tmp_path, 100)), "--profile", str(prof), *QUICK]
    argv += ["--out", str(tmp_path / "tuned.yaml")] if command[1] == "tune" else ["--json", str(out)]
    assert main(argv) == 2  # was 0, its throughput priced as if the requests fitted
    err = capsys.readouterr().err
    assert err == (
        f"--profile {prof}: KV room for {room} tokens; trace 't' has a request of 103 tokens "
        "(prompt and output): no engine with that room can hold it\n"
    )
    assert not out.exists() and not (tmp_path / "tuned.yaml").exists()


def test_a_request_that_fits_exactly_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile(tmp_path, 67.19)  # room for 76 tokens
    argv = ["sim", "replay", "--policy", "default", "--no-oracle", "--profile", str(prof), *QUICK]
    assert main([*argv, "--trace", str(_trace(tmp_path, 73)), "--json", str(tmp_path / "o.json")]) == 0
