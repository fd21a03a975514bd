"""The active policies: the sidecar's default and per-engine overrides, each revisioned with history.

Setting is atomic: the document is parsed completely first, and a broken one raises PolicyError and
leaves the active policy in force.

Restoring a snapshot loses only what is bad, and names each thing it drops: a history entry this
version refuses is dropped alone (by path and revision), and a current document it refuses (a rule
added since the version that saved it) does not take the valid earlier revisions with it, so
rollback still reaches the newest of them. A history or an overrides table of the wrong type is
dropped the same way, alone (the current default record, and the snapshot's engines and counters with
it, used to be moved aside with it). Revision numbers never go backwards across a restore, nor repeat
for an engine whose override a rollback removed and a later set gives one again (they started at 1
again; the last ``MAX_REMOVED`` such engines are remembered). Revisions out of order are bad values
like any other: a history entry not after the one before it is dropped alone, and a current record
not after its history's newest is refused (the default's: the snapshot; an override's: the override),
so a restored history is in increasing order below its current revision and rollback pops the newest.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controller.snapshot import SnapshotError, float_field, int_field, list_field, mapping_field, str_field
from controller.validation import MAX_TIME_S
from controller.wire.names import MAX_ENGINE_ID, has_control
from policies.spec import MAX_DOCUMENT_BYTES, PolicyError, PolicySpec, parse_policy, render_policy

HISTORY = 20
#: Engines whose override a rollback removed, remembered for their revision numbering.
MAX_REMOVED = 1024
#: Where a policy came from (a file name or preset), as the admin API accepts it.
MAX_SOURCE = 1024


class PolicyNotSaved(RuntimeError):
    """A policy change that could not be written to the state directory: it was not made."""


class NoPreviousPolicy(LookupError):
    """Rollback asked for with no earlier revision to return to."""


@dataclass(frozen=True, slots=True)
class PolicyRecord:
    spec: PolicySpec
    revision: int
    source: str
    set_at_s: float
    engine_id: str = ""  # empty: the default policy

    @property
    def yaml(self) -> str:
        return self.spec.source_yaml or render_policy(self.spec)

    def to_json(self) -> dict[str, Any]:
        return {
            "yaml": self.yaml,
            "revision": self.revision,
            "source": self.source,
            "set_at_s": self.set_at_s,
            "engine_id": self.engine_id,
        }

    @classmethod
    def from_json(cls, d: Any, *, path: str = "policy") -> PolicyRecord:
        """Raises SnapshotError (a value of the wrong type or range) or PolicyError (the document)."""
        if not isinstance(d, Mapping):
            raise SnapshotError(f"{path}: expected an object, got {type(d).__name__}")
        source = str_field(d, "source", path=path, max_len=MAX_SOURCE, default="<snapshot>", name=True)
        return cls(
            parse_policy(
                str_field(d, "yaml", path=path, max_len=MAX_DOCUMENT_BYTES), source=source, saved=True
            ),
            int_field(d, "revision", path=path, lo=1),
            source,
            float_field(d, "set_at_s", path=path, hi=MAX_TIME_S),
            str_field(d, "engine_id", path=path, max_len=MAX_ENGINE_ID, default="", name=True),
        )


@dataclass(slots=True)
class _Slot:
    current: PolicyRecord
    history: deque[PolicyRecord]


@dataclass(slots=True)
class _Kept:
    """An engine whose saved override was refused: it follows the default, but its valid earlier
    revisions stay for rollback (and in the snapshot), numbered after ``revision`` (the refused one).
    With no history: an engine whose override a rollback removed, ``revision`` its last."""

    revision: int
    history: deque[PolicyRecord]


class PolicyStore:
    def __init__(
        self,
        *,
        default: PolicySpec,
        source: str,
        clock: Callable[[], float] = time.time,
        history: int = HISTORY,
    ) -> None:
        self.clock = clock
        self._limit = history
        self._default = _Slot(PolicyRecord(default, 1, source, clock()), deque(maxlen=history))
        self._engines: dict[str, _Slot] = {}
        self._kept: dict[str, _Kept] = {}  # never an engine of _engines

    # -- reading ---------------------------------------------------------------------------------

    @property
    def default(self) -> PolicyRecord:
        return self._default.current

    def overrides(self) -> dict[str, PolicyRecord]:
        return {e: s.current for e, s in sorted(self._engines.items())}

    def effective(self, engine_id: str) -> PolicyRecord:
        """The policy an engine runs: its override, else the default."""
        s = self._engines.get(engine_id)
        return s.current if s is not None else self._default.current

    def get(self, engine_id: str = "") -> PolicyRecord:
        return self.effective(engine_id) if engine_id else self.default

    def history(self, engine_id: str = "") -> list[PolicyRecord]:
        """Earlier revisions, newest first."""
        s = (self._engines.get(engine_id) or self._kept.get(engine_id)) if engine_id else self._default
        return list(reversed(s.history)) if s is not None else []

    def copy(self) -> PolicyStore:
        """An independent copy (records are immutable; the slots and histories are copied)."""
        new = PolicyStore.__new__(PolicyStore)
        new.clock, new._limit = self.clock, self._limit
        new._default = _Slot(self._default.current, deque(self._default.history, maxlen=self._limit))
        new._engines = {
            e: _Slot(s.current, deque(s.history, maxlen=self._limit)) for e, s in self._engines.items()
        }
        new._kept = {
            e: _Kept(k.revision, deque(k.history, maxlen=self._limit)) for e, k in self._kept.items()
        }
        return new

    # -- changing --------------------------------------------------------------------------------

    def set(self, yaml_text: str, *, source: str, engine_id: str = "") -> PolicyRecord:
        """Parse and activate. Raises PolicyError (nothing changes) for a broken document."""
        return self.set_spec(
            parse_policy(yaml_text, source=source or "<policy>"), source=source, engine_id=engine_id
        )

    def set_spec(self, spec: PolicySpec, *, source: str, engine_id: str = "") -> PolicyRecord:
        slot = self._default if not engine_id else self._engines.get(engine_id)
        if slot is None:
            # a refused override's kept revisions become this override's history
            kept = self._kept.pop(engine_id, None) or _Kept(0, deque(maxlen=self._limit))
            rec = PolicyRecord(spec, kept.revision + 1, source, self.clock(), engine_id)
            self._engines[engine_id] = _Slot(rec, kept.history)
            return rec
        rec = PolicyRecord(spec, slot.current.revision + 1, source, self.clock(), engine_id)
        slot.history.append(slot.current)
        slot.current = rec
        return rec

    def rollback(self, engine_id: str = "") -> PolicyRecord:
        """Back to the previous revision (as a new revision). An engine override with no earlier
        revision is removed, so the engine follows the default again. Raises NoPreviousPolicy."""
        if engine_id:
            slot = self._engines.get(engine_id)
            kept = self._kept.get(engine_id) if slot is None else None
            if kept is not None and kept.history:
                # back to the newest revision saved before the refused one
                del self._kept[engine_id]
                prev = kept.history.pop()
                rec = PolicyRecord(prev.spec, kept.revision + 1, prev.source, self.clock(), engine_id)
                self._engines[engine_id] = _Slot(rec, kept.history)
                return rec
            if slot is None:
                raise NoPreviousPolicy(f"engine {engine_id!r} has no policy of its own to roll back")
            if not slot.history:
                del self._engines[engine_id]
                self._remember_removed(engine_id, slot.current.revision)
                return self.default
        else:
            slot = self._default
            if not slot.history:
                raise NoPreviousPolicy(f"no revision before {slot.current.revision} of the default policy")
        prev = slot.history.pop()
        slot.current = PolicyRecord(
            prev.spec, slot.current.revision + 1, prev.source, self.clock(), engine_id
        )
        return slot.current

    def _remember_removed(self, engine_id: str, revision: int) -> None:
        """Keep the last revision of an override rollback removed, so that a later override of the
        engine goes on numbering from it (it started at 1 again: two policies were "revision 1" of the
        same engine). At most ``MAX_REMOVED`` such marks, the oldest going first."""
        self._kept[engine_id] = _Kept(revision, deque(maxlen=self._limit))
        self._trim_removed()

    def _trim_removed(self) -> None:
        marks = [e for e, k in self._kept.items() if not k.history]
        for e in marks[: max(0, len(marks) - MAX_REMOVED)]:
            del self._kept[e]

    # -- snapshots -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        def slot(s: _Slot) -> dict[str, Any]:
            return {"current": s.current.to_json(), "history": [r.to_json() for r in s.history]}

        def kept(k: _Kept) -> dict[str, Any]:
            # no current: an older version drops the entry as it dropped the refused override
            return {"current": None, "revision": k.revision, "history": [r.to_json() for r in k.history]}

        engines = {e: slot(s) for e, s in self._engines.items()} | {e: kept(k) for e, k in self._kept.items()}
        return {"default": slot(self._default), "engines": engines}

    @classmethod
    def from_json(
        cls,
        d: Mapping[str, Any],
        *,
        clock: Callable[[], float] = time.time,
        history: int = HISTORY,
        problems: list[str] | None = None,
        path: str = "policies",
        fallback: Callable[[], tuple[PolicySpec, str]] | None = None,
    ) -> PolicyStore:
        """The store a snapshot saved. The default policy's current record is required (SnapshotError
        or PolicyError without it), but for ``fallback``: where the record is whole and only its
        document is refused (a rule added since the version that saved it), ``fallback()`` (the
        configured default policy and its source) serves instead, at the revision after every saved
        one, with the valid history kept for rollback; the rest of the snapshot is kept too. An
        engine override whose current record is refused (its document or a field) is dropped (the engine follows the default) but
        its valid history is kept for rollback. A bad history entry or engine override is dropped
        alone, and so is one whose revision is not after the entry before it; a current record whose
        revision is not after its history's newest is refused as a field of the wrong value is. Each
        thing dropped appends one line to ``problems``, naming its path (and revision)."""
        dropped = problems if problems is not None else []

        def past(s: Mapping[str, Any], at: str) -> deque[PolicyRecord]:
            """The valid history entries, oldest first; each bad one is dropped by itself."""
            kept: list[tuple[int, PolicyRecord]] = []
            try:
                saved = list_field(s, "history", path=at, max_len=10 * history)
            except SnapshotError as e:
                # not a list (or absurdly long): the history goes, the current record stays (it took
                # the whole snapshot with it: every policy, counter and engine, revisions back to 1)
                dropped.append(f"{e}; history dropped")
                saved = []
            for i, r in enumerate(saved):
                try:
                    rec = PolicyRecord.from_json(r, path=f"{at}.history[{i}]")
                except (SnapshotError, PolicyError) as e:
                    # what and where first: log lines are cut at 300 characters, reasons can be long
                    dropped.append(f"{at}.history[{i}]{_revision_of(r, at)} dropped: {e}")
                    continue
                if kept and rec.revision <= kept[-1][1].revision:
                    # Rollback pops the last entry as the newest earlier revision: one out of order
                    # (a hand edit) rolled back to an older policy than the newest.
                    dropped.append(
                        f"{at}.history[{i}].revision: {rec.revision} is not after the revision before it"
                        f" ({kept[-1][1].revision}); entry dropped"
                    )
                    continue
                kept.append((i, rec))
            # a snapshot from a store that kept more: the oldest go, as on set, each one named
            cut = max(0, len(kept) - history)
            for i, rec in kept[:cut]:
                dropped.append(
                    f"{at}.history[{i}] (revision {rec.revision}) dropped: only {history} are kept"
                )
            return deque((rec for _, rec in kept[cut:]), maxlen=history)

        def slot(
            s: Any, at: str, *, override: bool = False
        ) -> _Slot | tuple[ValueError, int, deque[PolicyRecord]]:
            """The slot, or (why its current record is refused, the revision after every saved one,
            its valid history) when its document is refused, or, for an engine's ``override``, any
            field of it (a value of the wrong type dropped the override's history with it, and its
            revisions went back to 1). A default record of the wrong shape fails the whole store."""
            if not isinstance(s, Mapping):
                raise SnapshotError(f"{at}: expected an object, got {type(s).__name__}")
            kept = past(s, at)
            try:
                current = PolicyRecord.from_json(s.get("current"), path=f"{at}.current")
                if kept and current.revision <= kept[-1].revision:
                    # The next revision is the current one's + 1: it would repeat one of the history's
                    # (or go below it), and the history would hold a revision newer than the current.
                    raise SnapshotError(
                        f"{at}.current.revision: {current.revision} is not after the history's newest"
                        f" revision ({kept[-1].revision})"
                    )
            except (PolicyError, SnapshotError) as e:
                if isinstance(e, SnapshotError) and not override:
                    raise
                # an unreadable revision is taken as 0: the history's revisions still keep the
                # numbering going forward
                cur = s.get("current")
                try:
                    revision = (
                        int_field(cur, "revision", path=f"{at}.current", lo=1)
                        if isinstance(cur, Mapping)
                        else 0
                    )
                except SnapshotError:
                    revision = 0
                return e, max([revision, *(r.revision for r in kept)]), kept
            return _Slot(current, kept)

        def kept_line(kept: deque[PolicyRecord]) -> str:
            n = len(kept)
            return f" ({n} earlier revisions kept for rollback, the newest {kept[-1].revision})" if n else ""

        default = slot(d.get("default"), f"{path}.default")
        if not isinstance(default, _Slot):
            e, revision, kept = default
            if fallback is None:
                raise e
            spec, source = fallback()
            dropped.append(
                f"{path}.default.current refused, the configured default policy {spec.name!r} serves"
                f" instead{kept_line(kept)}: {e}"
            )
            default = _Slot(PolicyRecord(spec, revision + 1, source, clock()), kept)
        store = cls(default=default.current.spec, source=default.current.source, clock=clock, history=history)
        store._default = default
        try:
            overrides = mapping_field(d, "engines", path=path)
        except SnapshotError as bad:  # as a bad override is: dropped, the rest (the default) restored
            dropped.append(f"{bad}; no engine's own policy restored (they follow the default)")
            overrides = {}
        for eid, s in overrides.items():
            at = f"{path}.engines[{eid!r}]"
            try:
                if not eid or len(eid) > MAX_ENGINE_ID or has_control(eid):
                    raise SnapshotError(f"{at}: not an engine id")
                if isinstance(s, Mapping) and s.get("current", 0) is None:
                    # what to_json writes for an override refused at an earlier start
                    # (or an override rollback removed: no history, only where its numbering is)
                    revision = int_field(s, "revision", path=at, lo=1)
                    kept = past(s, at)
                    store._kept[eid] = _Kept(max([revision, *(r.revision for r in kept)]), kept)
                    continue
                own = slot(s, at, override=True)
                if not isinstance(own, _Slot):
                    e, revision, kept = own
                    cur = s.get("current")
                    try:  # whose it was, where the record still says (else the key says)
                        owner = (
                            str_field(
                                cur, "engine_id", path=f"{at}.current", max_len=MAX_ENGINE_ID, name=True
                            )
                            if isinstance(cur, Mapping)
                            else eid
                        )
                    except SnapshotError:
                        owner = eid
                    if owner != eid:
                        raise SnapshotError(f"{at}: holds engine {owner!r}'s policy")
                    dropped.append(
                        f"{at}.current refused, the engine's own policy dropped (it follows the default)"
                        f"{kept_line(kept)}: {e}"
                    )
                    if kept:
                        store._kept[eid] = _Kept(revision, kept)
                    continue
                # the key decides which engine runs it, the record's id is what policy list shows
                if own.current.engine_id != eid:
                    raise SnapshotError(f"{at}: holds engine {own.current.engine_id!r}'s policy")
                store._engines[eid] = own
            except (SnapshotError, PolicyError) as e:
                dropped.append(f"{e}: the engine's own policy dropped (it follows the default)")
        store._trim_removed()
        return store


def _revision_of(r: Any, at: str) -> str:
    """``" (revision N)"`` for a dropped history entry whose revision can be read, else ``""``."""
    try:
        return f" (revision {int_field(r, 'revision', path=at, lo=1)})" if isinstance(r, Mapping) else ""
    except SnapshotError:
        return ""


__all__ = ["NoPreviousPolicy", "PolicyError", "PolicyRecord", "PolicyStore"]
