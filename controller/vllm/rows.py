"""Per-request bookkeeping the plugin keeps between hooks, in arrays indexed by the fast loop's slots.

For each live request: its traffic class (an index into a table of class names that only grows,
bounded by ``max_classes``), and the method, K and n-gram proposal (the draft length the n-gram
proposer had when the draft was planned) of the draft the composite drafter handed the scheduler,
until that draft is verified. ``columns`` turns one step's verified counts into the
report's columns in one kernel call, with no Python object per request.

What must hold: a request's planned (method, K) is read once, by the step that verifies its draft
(or dropped when the request leaves); the columns equal what the per-request rule gives (see
``columns``), whatever order requests arrive and leave in.
"""

from __future__ import annotations

import logging

import numpy as np

from policies.arms import METHOD_CODES, Method
from policies.jit import kernel
from policies.observation import NOT_SCORED

log = logging.getLogger("speccontrol.vllm")

_OFF = METHOD_CODES[Method.OFF]
_NGRAM = METHOD_CODES[Method.NGRAM]
DEFAULT_CLASS = "default"


#: Columns of the pending plan per slot: method code (-1: none), K, n-gram proposal (-1: unknown).
PLAN_METHOD, PLAN_K, PLAN_PROPOSAL = range(3)


@kernel
def columns_row(
    verifying: np.ndarray,
    s: int,
    sampled: int,
    drafted: int,
    cf: int,
    configured: int,
    max_k: int,
    proposal_before: int,
) -> tuple[int, int, int, int, int]:
    """(method, K, accepted, counterfactual, n-gram proposal) of slot ``s``'s verified step (see
    ``RequestTable.columns``)."""
    code = int(verifying[s, PLAN_METHOD])
    k = int(verifying[s, PLAN_K])
    proposal = int(verifying[s, PLAN_PROPOSAL])
    verifying[s, PLAN_METHOD] = -1
    verifying[s, PLAN_PROPOSAL] = -1
    if code < 0 or proposal < 0:  # no plan, or one made before the proposer knew the request
        proposal = proposal_before
    if code < 0:  # no plan recorded: the engine's own drafter, as scheduled
        code = configured if drafted else _OFF
        k = drafted
    if drafted == 0 and code != _NGRAM:
        code = _OFF
        k = 0
    elif code == _OFF:  # drafts a plan said not to make: the engine's drafter made them (the sidecar
        code = configured  # refuses an "off" row with drafts)
    if code == _NGRAM:
        cf = NOT_SCORED  # verified, not counterfactual
    # Counts within what the sidecar accepts (K <= max K, accepted <= drafted): it refuses a whole
    # report batch, every request's steps in it, over one row beyond them (a draft longer than the
    # engine's max K, or more tokens sampled than a draft allows for).
    drafted = min(drafted, max_k)
    return (
        code,
        min(max(k, drafted), max_k),
        (min(max(sampled - 1, 0), drafted) if drafted else 0),
        min(cf, max_k),
        min(proposal, max_k),
    )


@kernel
def _columns(
    verifying: np.ndarray,
    slots: np.ndarray,
    sampled: np.ndarray,
    drafted: np.ndarray,
    cf: np.ndarray,
    proposal: np.ndarray,
    configured: int,
    max_k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(slots)
    method = np.empty(n, dtype=np.int8)
    ks = np.empty(n, dtype=np.int32)
    accepted = np.empty(n, dtype=np.int32)
    for j in range(n):
        method[j], ks[j], accepted[j], cf[j], proposal[j] = columns_row(
            verifying, int(slots[j]), int(sampled[j]), int(drafted[j]), int(cf[j]), configured, max_k,
            int(proposal[j]),
        )  # fmt: skip
    return method, ks, accepted


class RequestTable:
    """Classes and pending plans of the requests in slots 0..capacity-1 (the fast loop's slots)."""

    def __init__(
        self, *, configured: Method, max_k: int, capacity: int = 64, max_classes: int = 1024
    ) -> None:
        self.configured = METHOD_CODES[configured]
        self.max_k = max_k
        self.max_classes = max_classes
        self._class_ids: dict[str, int] = {DEFAULT_CLASS: 0}
        #: Class names by index; replaced (never mutated) when one is added, so a record can hold it.
        self.class_names: tuple[str, ...] = (DEFAULT_CLASS,)
        self._full = False
        self._class = np.zeros(capacity, dtype=np.int32)
        self._verifying = np.full((capacity, 3), -1, dtype=np.int64)
        #: Async scheduling: the plan of each slot's latest placeholders (columns ``PLAN_*``), until a
        #: step that verifies them takes it (see ``StepKernel.place``).
        self._placed = np.full((capacity, 3), -1, dtype=np.int64)
        self._live = np.zeros(capacity, dtype=np.bool_)

    def admit(self, slots: np.ndarray, *, mark: bool = True) -> list[int]:
        """The positions of slots not admitted before (room is made for them; they read as: default
        class, no plan); ``mark``: they count as admitted from now on (until released)."""
        if len(slots):
            self.reserve(int(slots.max()) + 1)
        fresh = np.flatnonzero(~self._live[slots])
        if mark and len(fresh):
            self._live[slots[fresh]] = True
        return fresh.tolist()  # type: ignore[no-any-return]

    @property
    def capacity(self) -> int:
        return len(self._class)

    def reserve(self, capacity: int) -> None:
        """Room for slots below ``capacity``."""
        if capacity > len(self._class):
            n = max(capacity, 2 * len(self._class))
            cls = np.zeros(n, dtype=np.int32)
            cls[: len(self._class)] = self._class
            ver = np.full((n, 3), -1, dtype=np.int64)
            ver[: len(self._verifying)] = self._verifying
            placed = np.full((n, 3), -1, dtype=np.int64)
            placed[: len(self._placed)] = self._placed
            live = np.zeros(n, dtype=np.bool_)
            live[: len(self._live)] = self._live
            self._class, self._verifying, self._placed, self._live = cls, ver, placed, live

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per slot, for a caller's own kernel (``columns_row``): the pending plan (method, K, n-gram
        proposal; columns ``PLAN_*``), the class
        index, whether admitted. Arrays are replaced by ``reserve``."""
        return self._verifying, self._class, self._live

    @property
    def placed(self) -> np.ndarray:
        """Per slot the plan of its latest placeholders (async scheduling; -1: none); replaced by
        ``reserve``."""
        return self._placed

    def set_class(self, slot: int, name: str) -> None:
        """A new request's class (names beyond ``max_classes`` distinct ones count as the default)."""
        i = self._class_ids.get(name)
        if i is None:
            if len(self.class_names) >= self.max_classes:
                if not self._full:
                    self._full = True
                    log.warning("speccontrol: more than %d traffic classes; further ones count as %r",
                                self.max_classes, DEFAULT_CLASS)  # fmt: skip
                i = 0
            else:
                i = self._class_ids[name] = len(self.class_names)
                self.class_names = (*self.class_names, name)
        self._class[slot] = i

    def class_index(self, slots: np.ndarray) -> np.ndarray:
        out: np.ndarray = self._class[slots]
        return out

    def classes(self, slots: np.ndarray) -> list[str]:
        names = self.class_names
        return [names[i] for i in self._class[slots].tolist()]

    def planned(
        self, slots: np.ndarray, methods: np.ndarray, ks: np.ndarray, proposals: np.ndarray | None = None
    ) -> None:
        """The (method, K) of the drafts just handed to the scheduler, and the n-gram proposal each
        was planned with (None or -1: unknown), read back when verified."""
        self._verifying[slots, PLAN_METHOD] = methods
        self._verifying[slots, PLAN_K] = ks
        self._verifying[slots, PLAN_PROPOSAL] = -1 if proposals is None else proposals

    def release(self, slot: int) -> None:
        self._verifying[slot] = -1
        self._placed[slot] = -1
        self._class[slot] = 0
        self._live[slot] = False

    def columns(
        self,
        slots: np.ndarray,
        sampled: np.ndarray,
        drafted: np.ndarray,
        cf: np.ndarray,
        proposal: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step's (method int8, K int32, accepted int32) columns for requests that sampled
        ``sampled[j]`` tokens after a draft of ``drafted[j]``; ``cf`` (int32, n-gram's counterfactual)
        is made final in place, and so is ``proposal`` (int32: given as each request's n-gram proposal
        before this step, it becomes the one its verified draft was planned with where the plan
        recorded one; capped at max K).

        Per row: the plan recorded for the draft (consumed), or, without one, the configured method
        at the drafted length; a row that drafted nothing is off unless n-gram was planned (it drafted
        nothing there); K is at least the drafted length; accepted is sampled - 1 where a draft was
        verified; a verified n-gram draft has no counterfactual; counts are capped at max K."""
        return _columns(self._verifying, slots, sampled, drafted, cf, proposal, self.configured, self.max_k)  # type: ignore[no-any-return]
