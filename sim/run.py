"""What one replay produced: per-request times, totals and a per-step timeline, and its metrics.

A timeline's arm codes pack (method, K) for every K up to ``policies.arms.MAX_K``; ``arm_of_code``
inverts ``arm_code`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.arms import MAX_K, METHODS_BY_CODE, OFF, Arm, Method

#: arm code = method code * ARM_CODE_BASE + k, with k = 0..MAX_K: the base must exceed MAX_K (at 64,
#: ngram:64 read back as ``off`` and eagle3:64 as an arm that cannot exist, p_eagle:0).
ARM_CODE_BASE = MAX_K + 1


def arm_code(method: np.ndarray, k: np.ndarray) -> np.ndarray:
    return method.astype(np.int64) * ARM_CODE_BASE + k.astype(np.int64)


def arm_of_code(code: int) -> Arm:
    m = METHODS_BY_CODE[code // ARM_CODE_BASE]
    return OFF if m is Method.OFF else Arm(m, code % ARM_CODE_BASE)


@dataclass(frozen=True, slots=True)
class Timeline:
    """One entry per engine step."""

    end_s: np.ndarray
    emitted: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    arm: np.ndarray  # arm code used by most decoding requests in the step (-1: prefill only)


@dataclass(frozen=True, slots=True)
class RunResult:
    label: str
    engine: str
    concurrency: int
    open_loop: bool
    submit_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    output_tokens: np.ndarray
    steps: int
    request_steps: int  # decode request-steps
    drafted: int
    accepted: int
    switches: int
    timeline: Timeline

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max() - self.submit_s.min()) if len(self.finish_s) else 0.0

    @property
    def throughput(self) -> float:
        span = self.makespan_s
        return float(self.output_tokens.sum()) / span if span > 0 else 0.0

    def latency(self) -> dict[str, np.ndarray]:
        ttft = self.first_token_s - self.submit_s
        e2e = self.finish_s - self.submit_s
        multi = self.output_tokens > 1
        tpot = (self.finish_s[multi] - self.first_token_s[multi]) / (self.output_tokens[multi] - 1)
        return {"ttft": ttft, "e2e": e2e, "tpot": tpot}


def _pct(x: np.ndarray) -> dict[str, float | None]:
    if not len(x):
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(x * 1000.0, [50, 99])
    return {"p50": round(float(p50), 4), "p99": round(float(p99), 4)}


def metrics_block(
    run: RunResult,
    *,
    no_spec_throughput: float,
    cost_usd_per_1m: float,
    oracle_throughput: float | None,
) -> dict[str, Any]:
    """The per-concurrency block of the result JSON (keys fixed in docs/simulator.md)."""
    lat = run.latency()
    thr = run.throughput
    block: dict[str, Any] = {
        "throughput_tok_s": round(thr, 3),
        "speedup_vs_no_spec": round(thr / no_spec_throughput, 4) if no_spec_throughput > 0 else None,
        "acceptance_rate": round(run.accepted / run.drafted, 4) if run.drafted else 0.0,
        "mean_accepted_per_step": round(run.accepted / run.request_steps, 4) if run.request_steps else 0.0,
        "tpot_ms": _pct(lat["tpot"]),
        "ttft_ms": _pct(lat["ttft"]),
        "e2e_ms": _pct(lat["e2e"]),
        "cost_usd_per_1m_output_tokens": None if np.isnan(cost_usd_per_1m) else round(cost_usd_per_1m, 4),
        "switches": run.switches,
        # Arm changes per 1,000 engine steps: how often a person reading the decisions sees one.
        "switches_per_1k_steps": round(1000.0 * run.switches / run.steps, 3) if run.steps else 0.0,
    }
    if oracle_throughput is not None and oracle_throughput > 0:
        block["oracle"] = {
            "throughput_tok_s": round(oracle_throughput, 3),
            "ratio": round(thr / oracle_throughput, 4),
        }
    return block
