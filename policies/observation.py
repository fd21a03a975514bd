"""What the engine reports: one step as numpy columns (one row per request in the batch), and a
``StepBatch`` of steps, the one form every consumer of reports takes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


@dataclass(frozen=True, slots=True, init=False)
class StepBatch:
    """Steps in the order the engine ran them, as one set of columns: what every consumer of reports
    (the loop, its learners, the sidecar's metrics) takes, whether a report carried one step (the
    simulator) or hundreds (the sidecar).

    Per step (arrays over ``steps``): ``duration_s``, ``batch_size``, ``queue_length``,
    ``queue_wait_s``, ``prefill_tokens``, ``n`` (its rows). Per request (arrays over every step's rows,
    step i's rows at ``offsets[i]:offsets[i + 1]``): ``method``, ``k``, ``drafted``, ``accepted`` and
    ``traffic_class``. ``step_of`` maps each row to its step. ``steps`` keeps each step whole
    (``StepObservation``, sharing nothing mutable) for what looks at one step at a time.
    """

    steps: tuple[StepObservation, ...]
    offsets: np.ndarray
    n: np.ndarray
    step_of: np.ndarray
    duration_s: np.ndarray
    batch_size: np.ndarray
    queue_length: np.ndarray
    queue_wait_s: np.ndarray
    prefill_tokens: np.ndarray
    method: np.ndarray
    k: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    traffic_class: tuple[str, ...]

    def __init__(self, *, steps: Sequence[StepObservation]) -> None:
        steps = tuple(steps)
        n = np.fromiter((o.n for o in steps), np.int64, len(steps))
        offsets = np.zeros(len(steps) + 1, dtype=np.int64)
        np.cumsum(n, out=offsets[1:])
        cols: dict[str, np.ndarray] = {}
        for name, dtype in (
            ("method", np.int8),
            ("k", np.int32),
            ("drafted", np.int32),
            ("accepted", np.int32),
        ):
            parts = [getattr(o, name) for o in steps]
            cols[name] = (
                parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype)
            )
        for name, value in (
            ("steps", steps),
            ("offsets", offsets),
            ("n", n),
            ("step_of", np.repeat(np.arange(len(steps)), n)),
            ("duration_s", np.fromiter((o.duration_s for o in steps), np.float64, len(steps))),
            ("batch_size", np.fromiter((o.batch_size for o in steps), np.int64, len(steps))),
            ("queue_length", np.fromiter((o.queue_length for o in steps), np.int64, len(steps))),
            ("queue_wait_s", np.fromiter((o.queue_wait_s for o in steps), np.float64, len(steps))),
            ("prefill_tokens", np.fromiter((o.prefill_tokens for o in steps), np.int64, len(steps))),
            *cols.items(),
            (
                "traffic_class",
                steps[0].traffic_class if len(steps) == 1 else sum((o.traffic_class for o in steps), ()),
            ),
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, *steps: StepObservation) -> StepBatch:
        """A batch of the given steps (one for the simulator's step-by-step feed)."""
        return cls(steps=steps)

    def __len__(self) -> int:
        return len(self.steps)

    def rows(self, i: int) -> slice:
        """Step ``i``'s rows in the per-request columns."""
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def take(self, indices: Sequence[int]) -> StepBatch:
        """The batch of the steps at ``indices`` (in that order); this batch when that is all of it."""
        if len(indices) == len(self.steps) and list(indices) == list(range(len(self.steps))):
            return self
        return StepBatch(steps=[self.steps[i] for i in indices])

    def counterfactual(self, method: Method) -> np.ndarray:
        """``method``'s counterfactual counts on every row; ``NOT_SCORED`` on steps that have none."""
        return (
            np.concatenate(
                [o.counterfactual.get(method, np.full(o.n, NOT_SCORED, dtype=np.int32)) for o in self.steps]
            )
            if self.steps
            else np.zeros(0, dtype=np.int32)
        )

    def counterfactual_methods(self) -> list[Method]:
        """The methods any step scored, in the order the steps bring them."""
        return list(dict.fromkeys(m for o in self.steps for m in o.counterfactual))
