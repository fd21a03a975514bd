"""What an engine says about itself when it attaches: the arms it can apply and how finely."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from policies.arms import Arm, Method


class Granularity(IntEnum):
    """Values match ``controller.v1.Granularity``."""

    BATCH_STEP = 1  # one K per step for the whole engine (stock vLLM)
    REQUEST_K = 2  # K per request, one method
    REQUEST_METHOD = 3  # method and K per request (the plugin's composite drafter)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: str
    model: str
    max_k: int
    arms: tuple[Arm, ...]
    granularity: Granularity = Granularity.BATCH_STEP
    max_batch_size: int = 256
    counterfactual_methods: tuple[Method, ...] = ()
    p_eagle_partial_k_safe: bool = False

    @property
    def per_request(self) -> bool:
        return self.granularity is not Granularity.BATCH_STEP

    @property
    def primary_method(self) -> Method:
        """The engine-wide method a batch-granular engine drafts with."""
        for a in self.arms:
            if a.method is not Method.OFF:
                return a.method
        return Method.OFF

    def playable(self, candidates: tuple[Arm, ...]) -> tuple[Arm, ...]:
        """The candidates this engine can apply live (all its arms when ``candidates`` is empty).

        K is capped at the engine's maximum, and P-EAGLE is limited to K = max unless the engine
        reports its drafts stay aligned at smaller K (vLLM 0.32 misassigns them).
        """
        pool = candidates or self.arms
        out: list[Arm] = []
        for a in pool:
            if a not in self.arms:
                continue
            if a.k > self.max_k:
                continue
            if a.method is Method.P_EAGLE and a.k != self.max_k and not self.p_eagle_partial_k_safe:
                continue
            if a not in out:
                out.append(a)
        return tuple(out)
