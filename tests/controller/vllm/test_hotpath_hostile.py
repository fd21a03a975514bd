"""The fused after-update kernel (``StepKernel.after_update``) on steps vLLM should never produce, and on
the largest it does, compiled and not.

What must hold for any step: no exception, and every report row within what the sidecar accepts (K at
most the engine's max K, drafted at most K, accepted at most drafted, counterfactual and n-gram
proposal at most max K): the sidecar refuses a whole report batch, every request's steps in it, over
one row beyond them. The steps: 0 to 1,024 rows; drafts longer than max K; more tokens sampled than a
draft allows for; token ids -1, 0 and 2**31 - 1; requests with empty prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.vllm.control import Controls, engine_info
from controller.vllm.hotpath import ACCEPTED, CF, DRAFTED, PROPOSAL, K, StepKernel
from controller.vllm.ngram import NgramIndex
from controller.vllm.rows import RequestTable
from policies.arms import Arm, Method
from policies.observation import NOT_SCORED

pytestmark = pytest.mark.usefixtures("kernels")
MAX_K = 4
EDGE_IDS = (-1, 0, 7, 2**31 - 1)


def _kernel(max_k: int = MAX_K) -> tuple[StepKernel, RequestTable, NgramIndex]:
    info = engine_info(engine_id="e", model="m", method=Method.EAGLE3, max_k=max_k, max_batch_size=1024,
                       composite=True)  # fmt: skip
    controls = Controls(
        engine=info, method=Method.EAGLE3, safe_default=Arm(Method.EAGLE3, max_k), composite=True
    )
    rows = RequestTable(configured=Method.EAGLE3, max_k=max_k)
    ix = NgramIndex(max_k=max_k)
    return StepKernel(controls=controls, rows=rows, scorer=ix), rows, ix


def _check_rows(cols: np.ndarray, max_k: int) -> None:
    k, drafted, accepted = cols[K], cols[DRAFTED], cols[ACCEPTED]
    assert (k <= max_k).all(), k
    assert (drafted <= k).all(), (drafted, k)
    assert (accepted <= drafted).all(), (accepted, drafted)
    cf = cols[CF][cols[CF] != NOT_SCORED]
    assert (cf <= max_k).all() and (cols[PROPOSAL] <= max_k).all()


def _run(kernel: StepKernel, rows: RequestTable, ix: NgramIndex, steps: Sequence[tuple[list[str], list[list[int]],
         dict[str, list[int]]]], prompt: list[int]) -> None:  # fmt: skip
    for ids, gens, spec in steps:

        def start(j: int, slot: int, gens: list[list[int]] = gens) -> None:
            rows.set_class(slot, "default")
            ix.start(slot, prompt + gens[j])

        cols, finished, ended = kernel.after_update(ids, gens, spec, None, 0.3, start)
        assert cols.shape == (7, len(ids)) and ended == 0 and not finished.any()
        _check_rows(cols, MAX_K)


@st.composite
def hostile_steps(draw: st.DrawFn) -> tuple[list[tuple[list[str], list[list[int]], dict[str, list[int]]]], list[int]]:  # fmt: skip
    n = draw(st.integers(0, 48))
    ids = [f"r{i}" for i in range(n)]
    tok = st.sampled_from(EDGE_IDS)
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        spec = {rid: draw(st.lists(tok, max_size=3 * MAX_K)) for rid in ids}
        gens = [draw(st.lists(tok, min_size=1, max_size=3 * MAX_K + 2)) for _ in ids]
        steps.append((ids, gens, {rid: d for rid, d in spec.items() if d}))
    return steps, draw(st.lists(tok, max_size=40))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_steps())
def test_every_row_stays_within_what_the_sidecar_accepts(
    case: tuple[list[tuple[list[str], list[list[int]], dict[str, list[int]]]], list[int]],
) -> None:
    """Drafts of up to 3x max K, 1 to 3x max K + 2 tokens sampled (vLLM samples at most one past the
    draft); a report beyond max K lost the batch it went in."""
    steps, prompt = case
    kernel, rows, ix = _kernel()
    _run(kernel, rows, ix, steps, prompt)


def test_a_draft_longer_than_max_k_reports_max_k() -> None:
    """A draft of 6 on an engine of max K 4, all accepted: reported as 4 drafted, 4 accepted, K 4."""
    kernel, rows, ix = _kernel()
    _run(kernel, rows, ix, [(["a"], [[1]], {})], [1, 2, 3])
    cols, _, _ = kernel.after_update(["a"], [[5] * 7], {"a": [5] * 6}, None, 0.3, lambda j, s: None)
    assert (cols[K, 0], cols[DRAFTED, 0], cols[ACCEPTED, 0]) == (MAX_K, MAX_K, MAX_K)


@pytest.mark.parametrize("n", [0, 1, 1024])
def test_batches_from_empty_to_1024_rows(n: int) -> None:
    """An empty step, one row, and 1,024 rows with prompts of 0-64 tokens, through 3 steps."""
    rng = np.random.default_rng(n)
    kernel, rows, ix = _kernel()
    ids = [f"r{i}" for i in range(n)]
    prompts = {i: [int(t) for t in rng.choice(EDGE_IDS, int(rng.integers(0, 65)))] for i in range(n)}
    got: dict[str, list[int]] = {}
    for _ in range(3):
        gens = [[int(t) for t in rng.choice(EDGE_IDS, int(rng.integers(1, MAX_K + 2)))] for _ in ids]

        def start(j: int, slot: int, gens: list[list[int]] = gens) -> None:
            rows.set_class(slot, "default")
            ix.start(slot, prompts[j] + gens[j])  # the request's tokens after vLLM's update
            got[ids[j]] = list(prompts[j])

        cols, _, _ = kernel.after_update(ids, gens, {}, None, 0.3, start)
        assert cols.shape == (7, n)
        _check_rows(cols, MAX_K)
        for rid, g in zip(ids, gens, strict=True):
            got[rid] += g
    for rid, s in zip(ids, kernel.slots_of(ids), strict=True):
        assert ix.tokens(int(s)).tolist() == got[rid]
