"""Observe-only adapter for vLLM engines without the plugin: their Prometheus ``/metrics``.

Between two scrapes, vLLM's counters give the drafts verified, draft tokens, accepted tokens per
draft position (so the exact histogram of accepted counts per draft), engine iterations, and queue
time; gauges give running and waiting requests. ``observation_between`` turns that into one
``StepObservation`` the ControlLoop can learn from: one row per verified draft (downsampled), the
accepted histogram reproduced exactly, and a duration chosen so that the rows' goodput equals the
interval's real token rate. The loop can then recommend, but nothing applies its directives: vLLM's
K is fixed at start-up without the plugin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from policies.arms import METHOD_CODES, Method
from policies.observation import StepObservation

MAX_ROWS = 512


@dataclass(frozen=True, slots=True)
class VllmCounters:
    """The counters and gauges the adapter reads, summed over a server's engines."""

    time_s: float
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()
    iterations: float = 0.0
    queue_time_sum: float = 0.0
    queue_time_count: float = 0.0
    running: float = 0.0
    waiting: float = 0.0


def parse_metrics(text: str, *, time_s: float, model: str | None = None) -> VllmCounters:
    """Read vLLM's exposition text; raises ValueError when it is not Prometheus text."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises bare ValueError/TypeError variants
        raise ValueError(f"not Prometheus text: {e}") from None
    for fam in families:
        for s in fam.samples:
            if model is not None and s.labels.get("model_name", model) != model:
                continue
            if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(s.labels.get("position", "0"))
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            else:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    k = max(per_pos) + 1 if per_pos else 0
    return VllmCounters(
        time_s=time_s,
        drafts=sums.get("vllm:spec_decode_num_drafts_total", 0.0),
        draft_tokens=sums.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
        accepted=sums.get("vllm:spec_decode_num_accepted_tokens_total", 0.0),
        per_position=tuple(per_pos.get(i, 0.0) for i in range(k)),
        iterations=sums.get("vllm:iteration_tokens_total_count", 0.0),
        queue_time_sum=sums.get("vllm:request_queue_time_seconds_sum", 0.0),
        queue_time_count=sums.get("vllm:request_queue_time_seconds_count", 0.0),
        running=sums.get("vllm:num_requests_running", 0.0),
        waiting=sums.get("vllm:num_requests_waiting", 0.0),
    )


def observation_between(
    prev: VllmCounters, cur: VllmCounters, *, method: Method, max_rows: int = MAX_ROWS
) -> StepObservation | None:
    """One observation for the interval, or None when nothing was verified (or a counter reset)."""
    drafts = cur.drafts - prev.drafts
    dt = cur.time_s - prev.time_s
    if drafts <= 0 or dt <= 0 or cur.drafts < prev.drafts:
        return None
    deltas = np.array(
        [
            c - (prev.per_position[i] if i < len(prev.per_position) else 0.0)
            for i, c in enumerate(cur.per_position)
        ]
    )
    deltas = np.maximum(deltas, 0.0)
    # K: the mean drafted length, or more if some draft had a later position accepted (K varied).
    seen = int(np.flatnonzero(deltas)[-1]) + 1 if deltas.any() else 0
    k = max(1, round((cur.draft_tokens - prev.draft_tokens) / drafts), seen)
    pos = np.zeros(k)
    pos[: min(k, len(deltas))] = deltas[:k]
    # Drafts with exactly j accepted: reached position j, not position j + 1.
    reached = np.concatenate([[drafts], np.minimum.accumulate(np.minimum(pos, drafts))])
    hist = np.maximum(reached[:-1] - reached[1:], 0.0)
    hist = np.append(hist, reached[-1])  # all k accepted
    n = int(min(max_rows, drafts))
    counts = _apportion(hist, n)
    accepted = np.repeat(np.arange(k + 1), counts).astype(np.int32)
    iterations = cur.iterations - prev.iterations
    batch = max(1, round(drafts / iterations)) if iterations > 0 else max(1, round(cur.running))
    qn = cur.queue_time_count - prev.queue_time_count
    wait = (cur.queue_time_sum - prev.queue_time_sum) / qn if qn > 0 else 0.0
    code = METHOD_CODES[method]
    return StepObservation(
        time_s=cur.time_s,
        # The n rows stand for all `drafts` request-steps of the interval.
        duration_s=dt * n / drafts,
        batch_size=batch,
        queue_length=round(cur.waiting),
        queue_wait_s=max(wait, 0.0),
        traffic_class=("default",) * n,
        method=np.full(n, code, dtype=np.int8),
        k=np.full(n, k, dtype=np.int32),
        drafted=np.full(n, k, dtype=np.int32),
        accepted=accepted,
    )


def _apportion(weights: np.ndarray, n: int) -> np.ndarray:
    """Integer counts summing to n in proportion to weights (largest remainder)."""
    total = float(weights.sum())
    if total <= 0 or n <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    exact = weights * (n / total)
    base = np.floor(exact).astype(np.int64)
    short = n - int(base.sum())
    if short > 0:
        order = np.argsort(-(exact - base), kind="stable")[:short]
        base[order] += 1
    return base


def mean_accepted(obs: StepObservation) -> float:
    return float(obs.accepted.mean()) if obs.n else math.nan
