"""A test-only vLLM plugin for the tensor-parallel e2e (``test_vllm_tp``): it records, per worker
process, the drafts the V1 runner hands on each step (after the plugin's merge and the ranks'
agreement), so the test can require every rank to verify the same drafts; and it can make one rank's
merge fail. The tiny model's dummy weights cannot show ranks that verified different drafts in its
outputs: they are the same whatever the drafts. The async and synchronous e2e (``test_vllm_async``,
``test_vllm_plugin``) read the K vLLM's EAGLE proposer was called with on each step (``eagle_k``: the proposer's ``num_speculative_tokens``
per call), which nothing a user sees shows per step.

Registered beside the plugin by ``harness.plugin_path``; idle unless ``SPECCONTROL_E2E_RANK_PROBE``
names a directory. Writes ``DIR/<pid>.jsonl``, one ``{"rank", "reqs", "ngram_rows", "eagle_k",
"drafts"}`` a step. ``SPECCONTROL_E2E_RANK_FAULT=R:N``: rank R's N-th merge raises (N counts from 1). CPU only (it
reads the drafts on the host).
"""

from __future__ import annotations

import json
import os
from typing import Any


def register() -> None:
    where = os.environ.get("SPECCONTROL_E2E_RANK_PROBE")
    if not where:
        return
    import controller.vllm.worker as worker

    install = worker._runner_for  # the worker's V1 runner set-up, under either scheduling
    if getattr(install, "probed", False):
        return
    path = os.path.join(where, f"{os.getpid()}.jsonl")

    def install_then_probe(*args: Any) -> None:
        install(*args)
        from vllm.v1.spec_decode.llm_base_proposer import (  # type: ignore[import-not-found]
            SpecDecodeBaseProposer,
        )
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # type: ignore[import-not-found]

        propose = GPUModelRunner.propose_draft_token_ids
        if getattr(propose, "probed", False):
            return
        asked: list[int] = []
        eagle = SpecDecodeBaseProposer.propose

        def eagle_probed(self: Any, num_speculative_tokens: int, *a: Any, **k: Any) -> Any:
            asked.append(int(num_speculative_tokens))
            return eagle(self, num_speculative_tokens, *a, **k)

        SpecDecodeBaseProposer.propose = eagle_probed

        def probed(self: Any, so: Any, sampled: Any, *a: Any, **k: Any) -> Any:
            out = propose(self, so, sampled, *a, **k)
            rows = out.tolist() if hasattr(out, "tolist") else [list(d) for d in out]
            rec = {
                "rank": _rank(),
                "reqs": list(self.input_batch.req_ids),
                "ngram_rows": sorted(getattr(so, worker.NGRAM_ROWS_ATTR, None) or ()),
                "eagle_k": list(asked),
                "drafts": rows,
            }
            asked.clear()
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            return out

        probed.probed = True  # type: ignore[attr-defined]
        GPUModelRunner.propose_draft_token_ids = probed

    install_then_probe.probed = True  # type: ignore[attr-defined]
    worker._runner_for = install_then_probe

    fault = os.environ.get("SPECCONTROL_E2E_RANK_FAULT")
    if fault:
        rank, nth = (int(x) for x in fault.split(":"))
        merge, calls = worker._merge_step, [0]

        def failing(*a: Any) -> Any:
            if _rank() == rank:
                calls[0] += 1
                if calls[0] == nth:
                    raise RuntimeError(f"rank {rank}, merge {nth}: injected by tests/e2e/rank_probe.py")
            return merge(*a)

        worker._merge_step = failing


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
