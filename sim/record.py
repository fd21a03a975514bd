"""``controllerctl trace record``: record a spectrace from a running vLLM OpenAI server.

Each prompt is sent to ``/v1/completions`` (greedy, the traffic class in ``vllm_xargs``); the server must
run with ``--per-request-spec-decode-metrics detailed`` so every response carries its per-step accepted
and drafted counts. Responses are kept as JSON Lines beside the trace (``<out>.responses.jsonl``) and
converted with the importer, so the K-censoring rules are the importer's (see ``sim/importer.py``):
counts are exact below the recorded K and censored at it; record at a fixed K > 0. Responses also carry
their token ids (``return_token_ids``), from which the importer computes each position's n-gram proposal
(``ngram_proposal``, with the plugin's n-gram sizes: pass the engine's ``SPECCONTROL_NGRAM_MIN/MAX``),
the signal the plugin reports per step.

Prompt file: JSON Lines of ``{"prompt": "...", "class": "code", "max_tokens": 256}`` (class and
max_tokens optional; a class is a non-empty string, max_tokens in --max-tokens' range 2..2^22, both
checked before any request is sent), or plain text with one prompt per line.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.arms import Method
from policies.prompt_lookup import DEFAULT_MAX_N, DEFAULT_MIN_N
from sim.importer import import_vllm_metrics
from sim.trace import MAX_OUTPUT_TOKENS, Trace, TraceError, load_json_line, read_json_lines

MAX_PROMPTS = 100_000


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    traffic_class: str
    max_tokens: int


def read_prompts(path: str | Path, *, default_class: str, max_tokens: int) -> list[Prompt]:
    """Prompts from JSON Lines or plain text; errors name the file and line."""
    p = Path(path)
    out: list[Prompt] = []
    for lineno, raw in read_json_lines(p):
        line = raw.rstrip("\r\n")
        if len(out) >= MAX_PROMPTS:
            raise TraceError(f"more than {MAX_PROMPTS} prompts", source=str(p), line=lineno)
        if line.lstrip().startswith("{"):
            obj = load_json_line(line, source=str(p), line=lineno)
            text = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise TraceError("expected a non-empty string", source=str(p), line=lineno, field="prompt")
            cls = obj.get("class", default_class)
            n = obj.get("max_tokens", max_tokens)
            # Refused here, before any request: the importer refuses an empty class only after every
            # prompt was sent, and a max_tokens past the flag's range is sent as is (a failed request).
            if not isinstance(cls, str) or not cls:
                raise TraceError(
                    f"expected a non-empty string, got {json.dumps(cls)}",
                    source=str(p),
                    line=lineno,
                    field="class",
                )
            if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= MAX_OUTPUT_TOKENS:
                raise TraceError(
                    f"expected an integer 2..{MAX_OUTPUT_TOKENS} (as --max-tokens), got {json.dumps(n)}",
                    source=str(p),
                    line=lineno,
                    field="max_tokens",
                )
            out.append(Prompt(text, cls, n))
        else:
            out.append(Prompt(line, default_class, max_tokens))
    if not out:
        raise TraceError("no prompts", source=str(p))
    return out


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        try:
            obj = json.loads(resp.read())
        except RecursionError:  # a hostile or broken server: an error like any unreadable answer
            raise ValueError("the server answered with JSON nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise ValueError("the server answered with something other than a JSON object")
    return obj


def record(
    *,
    base_url: str,
    model: str,
    prompts: list[Prompt],
    responses_path: Path,
    concurrency: int = 4,
    timeout_s: float = 600.0,
    on_done: Callable[[int], None] | None = None,
    errors: list[str] | None = None,
) -> int:
    """Send every prompt; write each response (plus class and send time) as a JSON line. Returns failures
    (``errors``, when given, gets each failed request's error)."""
    url = base_url.rstrip("/") + "/v1/completions"
    start = time.monotonic()
    failures = 0

    def one(i_p: tuple[int, Prompt]) -> dict[str, Any] | None:
        i, p = i_p
        sent = time.monotonic() - start
        body = {
            "model": model,
            "prompt": p.text,
            "max_tokens": p.max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "vllm_xargs": {"traffic_class": p.traffic_class},
        }
        try:
            obj = _post(url, body, timeout_s)
        except (urllib.error.URLError, OSError, ValueError) as e:
            return {"error": str(e), "index": i}
        except http.client.HTTPException as e:
            # urllib passes a non-HTTP answer (BadStatusLine: a wrong port) or a cut body (IncompleteRead)
            # through unwrapped; like any failed request it is counted, not a traceback. Its str() alone
            # is the bytes received, so the kind is said too.
            return {"error": f"not a whole HTTP answer ({type(e).__name__}: {e!s:.200})", "index": i}
        obj["traffic_class"] = p.traffic_class
        obj["arrival_s"] = round(sent, 6)
        obj["id"] = f"r{i}"
        return obj

    responses_path.parent.mkdir(parents=True, exist_ok=True)
    with responses_path.open("w", encoding="utf-8") as f, ThreadPoolExecutor(max_workers=concurrency) as pool:
        for done, obj in enumerate(pool.map(one, enumerate(prompts)), start=1):
            if obj is None or "error" in obj:
                failures += 1
                if errors is not None:
                    errors.append(str(obj["error"]) if obj is not None else "no response")
            else:
                f.write(json.dumps(obj) + "\n")
            if on_done is not None:
                on_done(done)
    return failures


def record_trace(
    *,
    base_url: str,
    model: str,
    prompts: list[Prompt],
    out: Path,
    method: Method,
    concurrency: int = 4,
    on_done: Callable[[int], None] | None = None,
    ngram: tuple[int, int] = (DEFAULT_MIN_N, DEFAULT_MAX_N),
    warn: Callable[[str], None] | None = None,
) -> tuple[Trace, int, Path]:
    """Record responses and convert them; returns the trace, the failed requests and the responses file.
    ``ngram``: the (min_n, max_n) of the n-gram proposals computed from the responses' token ids;
    ``warn``: gets the import's warnings (default: stderr)."""
    responses = out.with_name(out.name.removesuffix(".gz").removesuffix(".jsonl") + ".responses.jsonl")
    errors: list[str] = []
    failures = record(
        base_url=base_url,
        model=model,
        prompts=prompts,
        responses_path=responses,
        concurrency=concurrency,
        on_done=on_done,
        errors=errors,
    )
    if prompts and failures == len(prompts):  # (the import would say only "no responses found")
        raise TraceError(f"every request failed ({failures}); the first: {errors[0]}", source=base_url)
    trace = import_vllm_metrics(responses, method=method, ngram=ngram, greedy=True, warn=warn)
    return trace, failures, responses
