"""What the engine reports for one step, as numpy columns (one row per request in the batch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from policies.arms import METHOD_CODES, Method

#: Marks a counterfactual count the engine did not score.
NOT_SCORED = -1


@dataclass(frozen=True, slots=True)
class StepObservation:
    """One engine step.

    The per-request columns are parallel arrays of equal length. ``counterfactual`` maps a method to
    its would-be accepted counts on the same rows, ``NOT_SCORED`` where the engine did not score it.
    A score is exact for drafts up to the method's ``counterfactual_depth`` (absent: the engine's max K;
    e.g. 1 for an EAGLE head's first position, which runs whether or not its draft is verified).
    ``ngram_proposal``: per request, the draft length the n-gram proposer had before the step drafted
    (0: no match, so n-gram could accept nothing there); None when the engine does not report it.
    """

    time_s: float
    duration_s: float
    batch_size: int
    queue_length: int
    queue_wait_s: float
    traffic_class: tuple[str, ...]
    method: np.ndarray  # int8 method codes (policies.arms.METHOD_CODES)
    k: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    counterfactual: Mapping[Method, np.ndarray] = field(default_factory=dict)
    request_id: tuple[str, ...] = ()
    finished: np.ndarray | None = None
    counterfactual_depth: Mapping[Method, int] = field(default_factory=dict)
    #: Prompt tokens prefilled in the same step (chunked prefill); their time is in ``duration_s``.
    prefill_tokens: int = 0
    ngram_proposal: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.traffic_class)

    @property
    def emitted(self) -> int:
        """Tokens the step emitted: accepted drafts plus the one token every request gets."""
        return int(self.accepted.sum()) + self.n

    @classmethod
    def build(
        cls,
        *,
        time_s: float,
        duration_s: float,
        traffic_class: list[str] | tuple[str, ...],
        method: list[Method] | np.ndarray,
        k: list[int] | np.ndarray,
        drafted: list[int] | np.ndarray,
        accepted: list[int] | np.ndarray,
        batch_size: int | None = None,
        queue_length: int = 0,
        queue_wait_s: float = 0.0,
        counterfactual: Mapping[Method, list[int] | np.ndarray] | None = None,
        request_id: list[str] | tuple[str, ...] = (),
        prefill_tokens: int = 0,
        ngram_proposal: list[int] | np.ndarray | None = None,
    ) -> StepObservation:
        """Convenience constructor from lists (tests, adapters)."""
        if isinstance(method, np.ndarray):
            codes = method.astype(np.int8)
        else:
            codes = np.array([METHOD_CODES[Method(m)] for m in method], dtype=np.int8)
        cf = {Method(m): np.asarray(v, dtype=np.int32) for m, v in (counterfactual or {}).items()}
        return cls(
            time_s=time_s,
            duration_s=duration_s,
            batch_size=len(traffic_class) if batch_size is None else batch_size,
            queue_length=queue_length,
            queue_wait_s=queue_wait_s,
            traffic_class=tuple(traffic_class),
            method=codes,
            k=np.asarray(k, dtype=np.int32),
            drafted=np.asarray(drafted, dtype=np.int32),
            accepted=np.asarray(accepted, dtype=np.int32),
            counterfactual=cf,
            request_id=tuple(request_id),
            prefill_tokens=prefill_tokens,
            ngram_proposal=None if ngram_proposal is None else np.asarray(ngram_proposal, dtype=np.int32),
        )
