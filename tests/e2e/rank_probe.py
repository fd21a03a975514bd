"""A test-only vLLM plugin that records, per worker process, the drafts the plugin's worker merge
hands back each step, so a tensor-parallel test can require every rank to have verified the same
drafts (``test_vllm_tp``). The tiny model's dummy weights cannot show a rank that drafted otherwise in
its outputs: they are the same whatever the drafts.

Registered beside the plugin by ``harness.plugin_path``; does nothing unless
``SPECCONTROL_E2E_RANK_PROBE`` names a directory. Writes ``DIR/<pid>.jsonl``, one
``{"reqs": [...], "drafts": [[...], ...]}`` a merge. CPU only (it reads the drafts on the host).
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

    merge = worker._merge_step
    if getattr(merge, "probed", False):
        return
    path = os.path.join(where, f"{os.getpid()}.jsonl")

    def probed(runner: Any, merger: Any, so: Any, sampled: Any, drafts: Any) -> Any:
        out = merge(runner, merger, so, sampled, drafts)
        rows = out.tolist() if hasattr(out, "tolist") else [list(d) for d in out]
        with open(path, "a") as f:
            f.write(json.dumps({"reqs": list(runner.input_batch.req_ids), "drafts": rows}) + "\n")
        return out

    probed.probed = True  # type: ignore[attr-defined]
    worker._merge_step = probed
