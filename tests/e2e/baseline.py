"""A plain engine's greedy outputs (no plugin, synchronous scheduling), for token-identity checks.

Run with the vLLM virtualenv's Python: ``python -m tests.e2e.baseline MODEL_DIR MAX_K MAX_TOKENS OUT
TAG...`` writes ``{tag: [token ids]}`` for the harness prompt of each tag, one request at a time
(as the tests send them), with the same engine shape as the server (``harness.ENGINE_ARGS``) and the
head ``SPECCONTROL_E2E_HEAD`` names (default ``eagle3``; ``peagle``: P-EAGLE), on the number of
tensor-parallel ranks ``SPECCONTROL_E2E_TP`` names (default 1; more: vLLM's multiprocessing executor).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.e2e.harness import ENGINE_ARGS, ENGINE_ENV, prompt, speculative_config, tp_args


def main(argv: list[str]) -> None:
    head = os.environ.get("SPECCONTROL_E2E_HEAD", "eagle3")
    tp = int(os.environ.get("SPECCONTROL_E2E_TP", "1"))
    model, max_k, max_tokens, out, tags = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3]), argv[4:]
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for k in ("SPECCONTROL_PLUGIN", "VLLM_PLUGINS", "SPECCONTROL_TEST_CPU_ASYNC"):
        os.environ.pop(k, None)  # a plain engine
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model / "target"),
        speculative_config=speculative_config(model, max_k, head),
        **ENGINE_ARGS,  # type: ignore[arg-type]
        **(tp_args(tp) if tp > 1 else {}),
    )
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    got = {t: list(llm.generate([prompt(t)], sp, use_tqdm=False)[0].outputs[0].token_ids) for t in tags}
    out.write_text(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1:])
