"""Checks of the per-request composite drafter under async scheduling, shared by the engine shapes
that run it (one worker: ``test_vllm_async``; tensor-parallel workers in their own processes:
``test_vllm_tp``), and the plain engine's outputs they compare with.

What must hold: every check reads only what a user sees (the completion's tokens and metrics, the
plugin's step trace, the engine's log), so the same check holds whatever runs the workers.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from tests.e2e.harness import ON_GPU, ROOT, VLLM_PY, Stack

#: The plain engine's outputs per tensor-parallel size, computed once a session (the tiny model's dummy
#: weights are the same in every stack of one shape).
_PLAIN: dict[int, dict[str, list[int]]] = {}
#: The prompts the n-gram and EAGLE checks send (``harness.prompt``).
TAGS = ("ngram-a", "eagle-a")


def plain_outputs(stack: Stack, *, max_k: int, tokens: int, tp: int = 1) -> dict[str, list[int]]:
    """``{tag: token ids}`` of a plain engine (no plugin, synchronous scheduling) of ``tp`` ranks. Dummy
    weights are drawn per shard, so an engine of 2 ranks is another model than one of 1: each shape is
    compared with its own plain engine."""
    if tp not in _PLAIN:
        out = stack.tmp / f"plain-tp{tp}.json"
        env = {**os.environ, "SPECCONTROL_E2E_TP": str(tp)}
        subprocess.run(
            [str(VLLM_PY), "-m", "tests.e2e.baseline", str(stack.tmp / "model"), str(max_k), str(tokens), str(out),
             *TAGS],
            cwd=ROOT, env=env, check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _PLAIN[tp] = json.loads(out.read_text())
    return _PLAIN[tp]


def request_rows(stack: Stack, resp: dict[str, Any]) -> list[dict[str, Any]]:
    """The plugin's trace rows of one completion."""
    return [r for r in stack.rows() if r["id"].startswith(resp["id"])]


def check_ngram_rows_accept_eagle_rows_do_not(
    stack: Stack, plain: dict[str, list[int]], *, tokens: int, max_k: int
) -> None:
    """Pinned to n-gram, a repetitive prompt's drafts are accepted; pinned to the dummy EAGLE head, they
    are not; either way the tokens are the plain engine's."""
    got: dict[str, dict[str, Any]] = {}
    for tag, arm, method in zip(
        TAGS, (f"ngram:{max_k}", f"eagle3:{max_k}"), ("ngram", "eagle3"), strict=True
    ):
        v = stack.set_policy(f"pin-{tag}", arm)
        resp = got[tag] = stack.complete(tokens, tag)
        rows = [r for r in request_rows(stack, resp) if r["dv"] >= v and r["drafted"]]
        # The first drafts of the request may have been planned before the pin reached it.
        settled = rows[2:]
        assert settled and all(r["method"] == method for r in settled), rows
        drafted, accepted = sum(r["drafted"] for r in settled), sum(r["accepted"] for r in settled)
        # Under async scheduling too the plan's n-gram proposal travels with each row, and the
        # repetitive output gives proposals wherever a draft is verified.
        assert all(0 <= r["ngram_proposal"] <= max_k for r in rows), rows
        assert sum(r["ngram_proposal"] > 0 for r in settled) > len(settled) // 2, settled
        if method == "ngram":
            assert accepted > drafted / 2, settled
        else:
            assert accepted < drafted / 2, settled
    for tag in got:
        assert got[tag]["choices"][0]["token_ids"] == plain[tag], tag
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    # The worker's drafter is a V1 setting (scripts/gpu_check.sh runs the V2 runner too).
    if "V1 model runner hook installed" in log:
        # (the drafter is built on the first draft)
        assert f"worker n-gram on the {stack.worker_ngram}" in log, stack.worker_ngram
    else:
        assert ON_GPU, "the V1 runner's hook is missing"


def check_k_follows_policy_set(stack: Stack, *, tokens: int = 40) -> None:
    """Each request (of ``tokens`` tokens) drafts with the method and K of the arm last set (and
    nothing when off)."""
    for name, arm, k, method in (
        ("k2", "ngram:2", 2, "ngram"),
        ("koff", "off", 0, "off"),
        ("k3", "eagle3:3", 3, "eagle3"),
    ):
        v = stack.set_policy(name, arm)
        resp = stack.complete(tokens, name)
        rows = [r for r in request_rows(stack, resp) if r["dv"] >= v]
        settled = rows[3:]  # planned under the new directive (async: one step more in flight)
        assert settled, rows
        if k == 0:
            assert all(r["drafted"] == 0 and r["method"] == "off" for r in settled), settled
        else:
            assert all(r["method"] == method and r["k"] == k and r["drafted"] == k for r in settled), settled
        drafted = set(resp["metrics"]["speculative_decoding"]["per_step_drafted"] or [])
        assert drafted <= {k} if k else not drafted, drafted
