"""P-EAGLE drafts at every depth in a real vLLM engine, recorded where the scheduler receives them.

Run with the vLLM virtualenv's Python: ``python -m tests.e2e.peagle_depths MODEL_DIR MAX_K MAX_TOKENS OUT
MODE``. One batch of ``PROMPTS`` (distinct prompts, so each request drafts its own tokens) is generated
greedily by an in-process engine (synchronous scheduling; vLLM's V1 multiprocessing off, so the scheduler
and the drafter live in this process) with the tiny target and the P-EAGLE head.

* ``plain``: no plugin, the engine at K max: ``{"max": {"tokens": ...}}``.
* ``plugin``: the plugin as vLLM loads it (entry point on ``PYTHONPATH``, no sidecar reachable, so the
  safe default is in force); the safe default is set to P-EAGLE at each K in ``MAX_K, 1 .. MAX_K - 1``
  in turn (the plugin turns it into the scheduler's K table and the per-request plan, as it would a
  directive), then, with the depth fix taken out again, at K = 2 (``"2-unfixed"``).

For each run: every request's output tokens and, per step, the draft the worker handed the scheduler
(``Scheduler.update_draft_token_ids``, before the plugin's per-request choice) and the draft the request
was then given. The test (``test_vllm_peagle.py``) compares them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.e2e.harness import ENGINE_ARGS, ENGINE_ENV, speculative_config

PROMPTS = (
    "alpha beta gamma delta alpha beta gamma delta",
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding draft token accept reject engine",
    "zeta eta theta iota scheduler metrics controller",
)


def _record(scheduler_cls: Any) -> dict[str, list[dict[str, list[int]]]]:
    """Wrap ``update_draft_token_ids`` (outside the plugin's wrapper): request id -> its drafts."""
    seen: dict[str, list[dict[str, list[int]]]] = {}
    inner = scheduler_cls.update_draft_token_ids

    def update_draft_token_ids(self: Any, draft_token_ids: Any) -> None:
        ids = list(draft_token_ids.req_ids)
        worker = [list(map(int, d)) for d in draft_token_ids.draft_token_ids]
        inner(self, draft_token_ids)
        for rid, d in zip(ids, worker, strict=True):
            req = self.requests.get(rid)
            given = [int(t) for t in req.spec_token_ids] if req is not None else []
            seen.setdefault(rid, []).append({"worker": d, "given": given})

    scheduler_cls.update_draft_token_ids = update_draft_token_ids
    return seen


def _run(llm: Any, sp: Any, seen: dict[str, list[dict[str, list[int]]]]) -> dict[str, Any]:
    seen.clear()
    outs = llm.generate(list(PROMPTS), sp, use_tqdm=False)
    drafts = []
    for o in outs:
        mine = [v for rid, v in seen.items() if rid == o.request_id or rid.startswith(o.request_id + "-")]
        drafts.append(mine[0] if len(mine) == 1 else [])
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "drafts": drafts}


def main(argv: list[str]) -> None:
    model, max_k, max_tokens, out, mode = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3]), argv[4]
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("SPECCONTROL_TEST_CPU_ASYNC", None)
    if mode == "plain":
        for k in ("SPECCONTROL_PLUGIN", "VLLM_PLUGINS"):
            os.environ.pop(k, None)
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    # Under the plugin vLLM prepares every K (the plugin's table may then use any); plain, K max only.
    spec = speculative_config(model, max_k, "peagle", every_k=mode != "plain")
    llm = LLM(model=str(model / "target"), speculative_config=spec, **ENGINE_ARGS)  # type: ignore[arg-type]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seen = _record(Scheduler)
    result: dict[str, Any] = {}
    if mode == "plain":
        result["max"] = _run(llm, sp, seen)
    else:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        from policies.arms import Arm, Method
        from policies.engine_rules import safe_default_directive

        hooks = llm.llm_engine.engine_core.engine_core.scheduler._speccontrol
        assert hooks is not None, "the plugin did not attach to the scheduler"
        result["mode"] = hooks.mode

        def safe_default(k: int, version: int) -> Any:
            # A version of its own each time, as the sidecar would issue (the table is cached by it).
            d = safe_default_directive(Arm(Method.P_EAGLE, k), max_k=max_k)
            return dataclasses.replace(d, version=version)

        for k in (max_k, *range(1, max_k)):
            hooks.controls.safe = safe_default(k, 1000 + k)
            result[str(k)] = _run(llm, sp, seen)
        fixed = SpecDecodeBaseProposer.propose
        SpecDecodeBaseProposer.propose = fixed.__wrapped__  # the depth fix taken out
        hooks.controls.safe = safe_default(2, 2000)
        result["2-unfixed"] = _run(llm, sp, seen)
        SpecDecodeBaseProposer.propose = fixed
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
