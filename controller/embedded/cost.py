"""Step time of the embedded engine: a verify forward, the drafters, and a fixed overhead.

Loosely calibrated to the fitted linear model for Llama-3.1-8B on one H100 in research/anchors.md
§6a (verify = KV term + per batched token + constant; overhead 1.2 ms) and to the ITL table in §6b
(each sequential EAGLE draft position adds ~0.6-1 ms; the first one ~1 ms). Worked values: batch 1,
1k context: plain 7.1 ms, EAGLE-3 K=3 9.4 ms; batch 48, 1k context: plain 10.2 ms, EAGLE-3 K=3
17 ms, so speculation needs good acceptance to pay at large batches. N-gram lookup is ~0.6 % of
the verify (CPU work on token arrays).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.arms import METHOD_CODES, Method

_EAGLE = METHOD_CODES[Method.EAGLE3]
_NGRAM = METHOD_CODES[Method.NGRAM]


@dataclass(frozen=True, slots=True)
class StepCost:
    kv_s_per_token: float = 3.92645679e-08
    batched_s_per_token: float = 2.10103129e-05
    verify_base_s: float = 5.88590713e-03
    overhead_s: float = 1.20683946e-03
    eagle_base_s: float = 0.35e-3
    eagle_position_s: float = 0.6e-3
    eagle_kv_s_per_token: float = 2.37768493e-09
    eagle_row_s: float = 8.41429603e-07
    ngram_fraction: float = 0.005875

    def duration(
        self, *, kv_tokens: np.ndarray, methods: np.ndarray, ks: np.ndarray, prefill_tokens: int = 0
    ) -> float:
        """Seconds for one step: every row verifies k + 1 tokens; new requests' prompts ride along."""
        spec = np.where(methods == METHOD_CODES[Method.OFF], 0, ks)
        kv = float(kv_tokens.sum())
        verify = (
            self.kv_s_per_token * kv
            + self.batched_s_per_token * (float((spec + 1).sum()) + prefill_tokens)
            + self.verify_base_s
        )
        eagle = (methods == _EAGLE) & (spec > 0)
        draft = 0.0
        if eagle.any():
            # Sequential draft positions: the longest K among EAGLE rows sets how many forwards run.
            per_position = (
                self.eagle_position_s
                + self.eagle_kv_s_per_token * float(kv_tokens[eagle].sum())
                + self.eagle_row_s * int(eagle.sum())
            )
            draft += self.eagle_base_s + per_position * int(spec[eagle].max())
        if ((methods == _NGRAM) & (spec > 0)).any():
            draft += self.ngram_fraction * verify
        return verify + draft + self.overhead_s
