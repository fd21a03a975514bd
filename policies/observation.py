"""What the engine reports: one step as numpy columns (one row per request in the batch), and a
``StepBatch`` of steps, the one form every consumer of reports takes."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

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


#: A step's counterfactual depths when it reports none (shared: never mutated).
_NO_DEPTH: Mapping[Method, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True, init=False)
class StepBatch:
    """Steps in the order the engine ran them, as one set of columns: what every consumer of reports
    (the loop, its learners, the sidecar's metrics) takes, whether a report carried one step (the
    simulator) or hundreds (the sidecar).

    Per step (arrays over ``steps``): ``time_s``, ``duration_s``, ``batch_size``, ``queue_length``,
    ``queue_wait_s``, ``prefill_tokens``, ``n`` (its rows), ``counterfactual_depth`` (a mapping per
    step). Per request (arrays over every step's rows, step i's rows at ``offsets[i]:offsets[i + 1]``):
    ``method``, ``k``, ``drafted``, ``accepted``, and the traffic class as ``class_of`` (an index into
    the distinct ``class_names``; ``traffic_class`` spells it out). ``step_of`` maps each row to its
    step. ``counterfactual(method)`` is a method's column over every row.

    Two ways in: ``StepBatch(steps=...)`` from whole steps (the simulator, tests), and
    ``StepBatch.from_columns(...)`` straight from decoded columns (the sidecar's ingest: no per-step
    object is built). ``steps`` gives each step whole either way (built from the columns on first use,
    for what looks at one step at a time); the columns are never written after construction.
    """

    offsets: np.ndarray
    n: np.ndarray
    step_of: np.ndarray
    time_s: np.ndarray
    duration_s: np.ndarray
    batch_size: np.ndarray
    queue_length: np.ndarray
    queue_wait_s: np.ndarray
    prefill_tokens: np.ndarray
    counterfactual_depth: tuple[Mapping[Method, int], ...]
    method: np.ndarray
    k: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    # Built on first use (None until then) from whichever form the batch came in.
    _steps: tuple[StepObservation, ...] | None
    _classes: tuple[tuple[str, ...], np.ndarray] | None
    # Columns only a batch built from columns carries up front (else read from ``_steps``):
    # request ids, finished flags, n-gram proposals (+ which steps reported them), counterfactual
    # columns (+ which steps scored each method).
    _extra: _Extra | None

    def __init__(self, *, steps: Sequence[StepObservation]) -> None:
        steps = tuple(steps)
        s = len(steps)
        n = np.fromiter((o.n for o in steps), np.int64, s)
        cols: dict[str, np.ndarray] = {}
        for name, dtype in (
            ("method", np.int8),
            ("k", np.int32),
            ("drafted", np.int32),
            ("accepted", np.int32),
        ):
            parts = [getattr(o, name) for o in steps]
            cols[name] = parts[0] if s == 1 else np.concatenate(parts) if parts else np.zeros(0, dtype)
        self._set(
            n=n,
            time_s=np.fromiter((o.time_s for o in steps), np.float64, s),
            duration_s=np.fromiter((o.duration_s for o in steps), np.float64, s),
            batch_size=np.fromiter((o.batch_size for o in steps), np.int64, s),
            queue_length=np.fromiter((o.queue_length for o in steps), np.int64, s),
            queue_wait_s=np.fromiter((o.queue_wait_s for o in steps), np.float64, s),
            prefill_tokens=np.fromiter((o.prefill_tokens for o in steps), np.int64, s),
            counterfactual_depth=tuple(o.counterfactual_depth for o in steps),
            steps=steps,
            classes=None,
            extra=None,
            **cols,
        )

    @classmethod
    def from_columns(
        cls,
        *,
        n: np.ndarray,
        time_s: np.ndarray,
        duration_s: np.ndarray,
        batch_size: np.ndarray,
        queue_length: np.ndarray,
        queue_wait_s: np.ndarray,
        prefill_tokens: np.ndarray,
        method: np.ndarray,
        k: np.ndarray,
        drafted: np.ndarray,
        accepted: np.ndarray,
        class_names: tuple[str, ...],
        class_of: np.ndarray,
        request_id: tuple[str, ...],
        finished: np.ndarray,
        ngram_proposal: np.ndarray,
        ngram_reported: np.ndarray,
        counterfactual: Mapping[Method, tuple[np.ndarray, np.ndarray]],
    ) -> StepBatch:
        """A batch from columns already checked: per step ``n`` and the scalars (int64 / float64);
        per row ``method`` (int8), ``k``, ``drafted``, ``accepted`` (int32), ``class_of`` (int64 into
        the distinct ``class_names``), ``request_id`` ("" where the step sent none), ``finished``
        (bool), ``ngram_proposal`` (int32; read only on steps whose ``ngram_reported`` is set);
        ``counterfactual``: method -> (its column over every row, ``NOT_SCORED`` on steps that did
        not score it; per step, whether it scored it)."""
        batch = cls.__new__(cls)
        batch._set(
            n=n,
            time_s=time_s,
            duration_s=duration_s,
            batch_size=batch_size,
            queue_length=queue_length,
            queue_wait_s=queue_wait_s,
            prefill_tokens=prefill_tokens,
            counterfactual_depth=(_NO_DEPTH,) * len(n),
            method=method,
            k=k,
            drafted=drafted,
            accepted=accepted,
            steps=None,
            classes=(class_names, class_of),
            extra=_Extra(request_id, finished, ngram_proposal, ngram_reported, counterfactual),
        )
        return batch

    def _set(
        self,
        *,
        n: np.ndarray,
        steps: tuple[StepObservation, ...] | None,
        classes: tuple[tuple[str, ...], np.ndarray] | None,
        extra: _Extra | None,
        **fields: Any,
    ) -> None:
        offsets = np.zeros(len(n) + 1, dtype=np.int64)
        np.cumsum(n, out=offsets[1:])
        setattr_ = object.__setattr__
        setattr_(self, "n", n)
        setattr_(self, "offsets", offsets)
        setattr_(self, "step_of", np.repeat(np.arange(len(n)), n))
        setattr_(self, "_steps", steps)
        setattr_(self, "_classes", classes)
        setattr_(self, "_extra", extra)
        for name, value in fields.items():
            setattr_(self, name, value)

    @classmethod
    def of(cls, *steps: StepObservation) -> StepBatch:
        """A batch of the given steps (one for the simulator's step-by-step feed)."""
        return cls(steps=steps)

    def __len__(self) -> int:
        return len(self.n)

    def rows(self, i: int) -> slice:
        """Step ``i``'s rows in the per-request columns."""
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    @property
    def class_names(self) -> tuple[str, ...]:
        """The distinct traffic classes the rows name (``class_of`` indexes them)."""
        return self._class_columns()[0]

    @property
    def class_of(self) -> np.ndarray:
        """Per row, its traffic class as an index into ``class_names`` (int64)."""
        return self._class_columns()[1]

    @property
    def traffic_class(self) -> tuple[str, ...]:
        """Per row, its traffic class by name."""
        names, of = self._class_columns()
        if len(names) == 1:
            return names * len(of)
        return tuple(names[j] for j in of.tolist())

    def classes_in(self, rows: np.ndarray | slice) -> list[tuple[str, int]]:
        """The traffic classes the selected rows name, as (name, index into ``class_names``), by name."""
        names, of = self._class_columns()
        return sorted((names[j], j) for j in set(of[rows].tolist()))

    def _class_columns(self) -> tuple[tuple[str, ...], np.ndarray]:
        if self._classes is None:
            assert self._steps is not None
            index: dict[str, int] = {}
            parts = []
            for o in self._steps:
                tc = o.traffic_class
                if tc and tc.count(tc[0]) == len(tc):  # the usual step: one class
                    parts.append(np.full(len(tc), index.setdefault(tc[0], len(index)), dtype=np.int64))
                else:
                    parts.append(
                        np.fromiter((index.setdefault(c, len(index)) for c in tc), np.int64, len(tc))
                    )
            of = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int64)
            object.__setattr__(self, "_classes", (tuple(index), of))
        assert self._classes is not None
        return self._classes

    @property
    def steps(self) -> tuple[StepObservation, ...]:
        """Each step whole (built from the columns on first use when the batch came as columns)."""
        if self._steps is None:
            object.__setattr__(self, "_steps", tuple(self._step(i) for i in range(len(self))))
        assert self._steps is not None
        return self._steps

    def _step(self, i: int) -> StepObservation:
        assert self._extra is not None
        x = self._extra
        r = self.rows(i)
        names, of = self._class_columns()
        return StepObservation(
            time_s=float(self.time_s[i]),
            duration_s=float(self.duration_s[i]),
            batch_size=int(self.batch_size[i]),
            queue_length=int(self.queue_length[i]),
            queue_wait_s=float(self.queue_wait_s[i]),
            traffic_class=tuple(names[j] for j in of[r].tolist()),
            method=self.method[r],
            k=self.k[r],
            drafted=self.drafted[r],
            accepted=self.accepted[r],
            counterfactual=self.step_counterfactual(i),
            request_id=x.request_id[r],
            finished=x.finished[r],
            counterfactual_depth=self.counterfactual_depth[i],
            prefill_tokens=int(self.prefill_tokens[i]),
            ngram_proposal=x.ngram_proposal[r] if x.ngram_reported[i] else None,
        )

    def step_counterfactual(self, i: int) -> Mapping[Method, np.ndarray]:
        """Step ``i``'s counterfactual columns (the methods it scored, in the order it sent them)."""
        if self._extra is None:
            return self.steps[i].counterfactual
        r = self.rows(i)
        return {m: col[r] for m, (col, scored) in self._extra.counterfactual.items() if scored[i]}

    def renamed(self, rename: Mapping[str, str]) -> StepBatch:
        """The batch with the traffic classes in ``rename`` renamed (two names may become one)."""
        if self._extra is None:
            return StepBatch(
                steps=[
                    replace(o, traffic_class=tuple(rename.get(c, c) for c in o.traffic_class))
                    for o in self.steps
                ]
            )
        names, of = self._class_columns()
        new = tuple(dict.fromkeys(rename.get(c, c) for c in names))
        index = {c: i for i, c in enumerate(new)}
        lut = np.array([index[rename.get(c, c)] for c in names], dtype=np.int64)
        batch = copy.copy(self)
        object.__setattr__(batch, "_classes", (new, lut[of]))
        object.__setattr__(batch, "_steps", None)
        return batch

    def take(self, indices: Sequence[int]) -> StepBatch:
        """The batch of the steps at ``indices`` (in that order); this batch when that is all of it."""
        if len(indices) == len(self) and list(indices) == list(range(len(self))):
            return self
        if self._steps is not None:
            return StepBatch(steps=[self._steps[i] for i in indices])
        assert self._extra is not None
        x = self._extra
        idx = np.asarray(indices, dtype=np.int64)
        rows = (
            np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in idx.tolist()])
            if len(idx)
            else np.zeros(0, np.int64)
        )
        names, of = self._class_columns()
        return StepBatch.from_columns(
            n=self.n[idx],
            time_s=self.time_s[idx],
            duration_s=self.duration_s[idx],
            batch_size=self.batch_size[idx],
            queue_length=self.queue_length[idx],
            queue_wait_s=self.queue_wait_s[idx],
            prefill_tokens=self.prefill_tokens[idx],
            method=self.method[rows],
            k=self.k[rows],
            drafted=self.drafted[rows],
            accepted=self.accepted[rows],
            class_names=names,
            class_of=of[rows],
            request_id=tuple(x.request_id[j] for j in rows.tolist()),
            finished=x.finished[rows],
            ngram_proposal=x.ngram_proposal[rows],
            ngram_reported=x.ngram_reported[idx],
            counterfactual={m: (col[rows], scored[idx]) for m, (col, scored) in x.counterfactual.items()},
        )

    def counterfactual(self, method: Method) -> np.ndarray:
        """``method``'s counterfactual counts on every row; ``NOT_SCORED`` on steps that have none."""
        if self._extra is not None:
            col = self._extra.counterfactual.get(method)
            return col[0] if col is not None else np.full(len(self.method), NOT_SCORED, dtype=np.int32)
        steps = self.steps
        return (
            np.concatenate(
                [o.counterfactual.get(method, np.full(o.n, NOT_SCORED, dtype=np.int32)) for o in steps]
            )
            if steps
            else np.zeros(0, dtype=np.int32)
        )

    def counterfactual_methods(self) -> list[Method]:
        """The methods any step scored, in the order the steps bring them."""
        if self._extra is not None:
            return list(self._extra.counterfactual)
        return list(dict.fromkeys(m for o in self.steps for m in o.counterfactual))


@dataclass(frozen=True, slots=True)
class _Extra:
    """The columns a batch built from columns carries besides the ones every consumer reads."""

    request_id: tuple[str, ...]
    finished: np.ndarray
    ngram_proposal: np.ndarray
    ngram_reported: np.ndarray
    #: method -> (column over every row, per step whether the step scored it), in the order the
    #: steps bring the methods.
    counterfactual: Mapping[Method, tuple[np.ndarray, np.ndarray]]
