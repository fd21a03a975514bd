"""Import traces from vLLM's per-request speculative-decoding metrics.

vLLM (``--per-request-spec-decode-metrics detailed``) returns, when a request finishes,
``metrics.speculative_decoding.per_step_accepted`` / ``per_step_drafted``: one entry per verify step.
That is what one configuration saw, not every method at every position, so the imported trace is
an approximation of ``spectrace`` semantics, stated in its header ``meta``:

* At a step's start position t the count is exact when fewer tokens were accepted than drafted, and
  censored at the drafted K otherwise (recorded as K: replays with a larger K see no more).
* Positions inside an accepted run get the rest of the run (t + j accepts a - j), as the same
  drafter would have proposed the same accepted tokens.
* Steps without drafts (K = 0 phases) are not reported by vLLM, so positions after such a phase are
  misaligned; import traces recorded at a fixed K > 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from policies.arms import Method
from sim.trace import TRACE_METHODS, Trace, TraceError, _open_text


def _spec_metrics(obj: dict[str, Any]) -> Any:
    m = obj.get("metrics")
    if not isinstance(m, dict):
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            m = choices[0].get("metrics")
    return m.get("speculative_decoding") if isinstance(m, dict) else None


def counts_from_steps(output_tokens: int, accepted: list[int], drafted: list[int]) -> np.ndarray:
    """Per-position counts for one request from its per-step accepted / drafted lists."""
    acc = np.zeros(output_tokens, dtype=np.int32)
    done = 1
    for a, d in zip(accepted, drafted, strict=True):
        pos = done - 1
        if pos >= output_tokens - 1:
            break
        a = min(a, d)
        run = np.arange(a, -1, -1)[: output_tokens - pos]
        acc[pos : pos + len(run)] = run
        done += a + 1
    return acc


def import_vllm_metrics(path: str | Path, *, method: Method = Method.EAGLE3) -> Trace:
    """A trace from JSON Lines of vLLM responses (completions or chat) carrying detailed spec metrics.

    Each line: a response object with ``usage.prompt_tokens``, ``usage.completion_tokens`` and
    ``metrics.speculative_decoding.per_step_accepted/per_step_drafted``; optional ``id``,
    ``traffic_class`` (or ``class``) and ``arrival_s`` fields are carried over.
    """
    if method not in TRACE_METHODS:
        raise TraceError(f"cannot import method {method.value!r}", source=str(path))
    p = Path(path)
    ids: list[str] = []
    classes: list[str] = []
    prompt: list[int] = []
    out: list[int] = []
    arrival: list[float] = []
    acc: list[np.ndarray] = []
    max_k = 1
    try:
        with _open_text(p) as f:
            for lineno, text in enumerate(f, start=1):
                if not text.strip():
                    continue

                def fail(fld: str, msg: str, lineno: int = lineno) -> TraceError:
                    return TraceError(msg, source=str(p), line=lineno, field=fld)

                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise fail("", f"invalid JSON: {e.msg} (column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise fail("", "expected a JSON object (a vLLM response)")
                usage = obj.get("usage")
                if not isinstance(usage, dict):
                    raise fail(
                        "usage", "missing: the response needs usage.prompt_tokens and completion_tokens"
                    )
                n_out = usage.get("completion_tokens")
                n_in = usage.get("prompt_tokens", 0)
                if not isinstance(n_out, int) or n_out < 1:
                    raise fail("usage.completion_tokens", f"expected an integer >= 1, got {n_out!r}")
                if not isinstance(n_in, int) or n_in < 0:
                    raise fail("usage.prompt_tokens", f"expected an integer >= 0, got {n_in!r}")
                sd = _spec_metrics(obj)
                if not isinstance(sd, dict):
                    raise fail(
                        "metrics.speculative_decoding",
                        "missing (start vLLM with --per-request-spec-decode-metrics detailed)",
                    )
                pa, pd = sd.get("per_step_accepted"), sd.get("per_step_drafted")
                ok = (
                    isinstance(pa, list)
                    and isinstance(pd, list)
                    and len(pa) == len(pd)
                    and all(isinstance(x, int) and x >= 0 for x in pa + pd)
                )
                if not ok:
                    raise fail(
                        "metrics.speculative_decoding.per_step_accepted",
                        "per_step_accepted and per_step_drafted must be equal-length lists of integers "
                        "(use --per-request-spec-decode-metrics detailed)",
                    )
                assert isinstance(pa, list) and isinstance(pd, list)
                rid = obj.get("id", f"line{lineno}")
                ids.append(str(rid) if str(rid) not in ids else f"{rid}-{lineno}")
                classes.append(str(obj.get("traffic_class", obj.get("class", "default"))))
                prompt.append(n_in)
                out.append(n_out)
                arr = obj.get("arrival_s")
                arrival.append(float(arr) if isinstance(arr, int | float) else float("nan"))
                acc.append(counts_from_steps(n_out, pa, pd))
                max_k = max([max_k, *pd])
    except OSError as e:
        raise TraceError(f"cannot read: {e}", source=str(p)) from None
    if not ids:
        raise TraceError("no responses found", source=str(p))
    arrivals = np.array(arrival)
    if np.isnan(arrivals).any():
        arrivals[:] = np.nan  # all or none
    return Trace(
        max_k=max_k,
        methods=(method,),
        ids=tuple(ids),
        classes=tuple(classes),
        prompt_tokens=np.array(prompt, dtype=np.int64),
        output_tokens=np.array(out, dtype=np.int64),
        arrival_s=arrivals,
        acc={method: np.concatenate(acc)},
        meta={
            "imported_from": "vllm per-request spec decode metrics (detailed)",
            "source_file": p.name,
            "censored_at_recorded_k": True,
            "note": "counts are exact below the recorded K and censored at it; K = 0 phases are not recorded",
        },
        name=p.name.removesuffix(".gz").removesuffix(".jsonl"),
    )
