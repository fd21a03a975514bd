from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies.arms import Method
from sim.cli import main
from sim.costmodel import load_profile
from sim.engines import ENGINES
from sim.importer import counts_from_steps, import_vllm_metrics
from sim.trace import read_trace
from sim.vectorised import replay_static

# The body captured from vLLM 0.32 in research/vllm-integration.md (max_tokens = 40).
CAPTURED = {
    "id": "cmpl-1",
    "usage": {"prompt_tokens": 12, "completion_tokens": 40},
    "metrics": {
        "speculative_decoding": {
            "num_spec_tokens": 4,
            "per_step_accepted": [2, 2, 4, 4, 4, 4, 4, 4, 4],
            "per_step_drafted": [2, 2, 4, 4, 4, 4, 4, 4, 4],
        }
    },
}


def test_counts_from_steps() -> None:
    # Step at t0 accepted 2 of 3 drafted (exact), then t3 accepted 3 of 3 (censored), 2 tokens left.
    assert counts_from_steps(9, [2, 3, 1], [3, 3, 3]).tolist() == [2, 1, 0, 3, 2, 1, 0, 1, 0]


def test_captured_response_replays_the_recorded_steps(tmp_path: Path) -> None:
    src = tmp_path / "responses.jsonl"
    src.write_text(json.dumps(CAPTURED) + "\n")
    t = import_vllm_metrics(src)
    assert (t.max_k, t.methods, t.output_tokens.tolist()) == (4, (Method.EAGLE3,), [40])
    r = replay_static(
        t,
        method=Method.EAGLE3,
        k=4,
        concurrency=1,
        profile=load_profile("llama-3.1-8b-h100"),
        engine=ENGINES["stock-vllm"],
    )
    assert r.request_steps == 9  # num_spec_steps in the capture
    assert r.accepted == 2 + 2 + 4 * 6 + 2  # the last step is cut at max_tokens


def test_trace_import_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "responses.jsonl"
    bad = {"id": "x", "usage": {"prompt_tokens": 1, "completion_tokens": 5}, "metrics": {}}
    src.write_text(json.dumps(CAPTURED) + "\n")
    out = tmp_path / "imported.jsonl.gz"
    assert main(["trace", "import", str(src), "--out", str(out)]) == 0
    assert read_trace(out).n == 1
    src.write_text(json.dumps(CAPTURED) + "\n" + json.dumps(bad) + "\n")
    assert main(["trace", "import", str(src), "--out", str(tmp_path / "no.jsonl")]) == 2
    assert not (tmp_path / "no.jsonl").exists()
    assert capsys.readouterr().err.startswith(f"{src}:2: metrics.speculative_decoding: missing")
