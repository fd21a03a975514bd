"""The active policies: the sidecar's default and per-engine overrides, each revisioned with history.

Setting is atomic: the document is parsed completely first, and a broken one raises PolicyError and
leaves the active policy in force.
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
        s = self._engines.get(engine_id) if engine_id else self._default
        return list(reversed(s.history)) if s is not None else []

    def copy(self) -> PolicyStore:
        """An independent copy (records are immutable; the slots and histories are copied)."""
        new = PolicyStore.__new__(PolicyStore)
        new.clock, new._limit = self.clock, self._limit
        new._default = _Slot(self._default.current, deque(self._default.history, maxlen=self._limit))
        new._engines = {
            e: _Slot(s.current, deque(s.history, maxlen=self._limit)) for e, s in self._engines.items()
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
            rec = PolicyRecord(spec, 1, source, self.clock(), engine_id)
            self._engines[engine_id] = _Slot(rec, deque(maxlen=self._limit))
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
            if slot is None:
                raise NoPreviousPolicy(f"engine {engine_id!r} has no policy of its own to roll back")
            if not slot.history:
                del self._engines[engine_id]
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

    # -- snapshots -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        def slot(s: _Slot) -> dict[str, Any]:
            return {"current": s.current.to_json(), "history": [r.to_json() for r in s.history]}

        return {"default": slot(self._default), "engines": {e: slot(s) for e, s in self._engines.items()}}

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
        configured default policy and its source) serves instead, at the next revision, and the rest
        of the snapshot is kept. A bad history entry or engine override is dropped alone, with a
        line appended to ``problems``."""
        dropped = problems if problems is not None else []

        def slot(s: Any, at: str) -> _Slot:
            if not isinstance(s, Mapping):
                raise SnapshotError(f"{at}: expected an object, got {type(s).__name__}")
            current = PolicyRecord.from_json(s.get("current"), path=f"{at}.current")
            past: deque[PolicyRecord] = deque(maxlen=history)
            for i, r in enumerate(list_field(s, "history", path=at, max_len=10 * history)[-history:]):
                try:
                    past.append(PolicyRecord.from_json(r, path=f"{at}.history[{i}]"))
                except (SnapshotError, PolicyError) as e:
                    dropped.append(f"{e}: history entry dropped")
            return _Slot(current, past)

        try:
            default = slot(d.get("default"), f"{path}.default")
        except PolicyError as e:
            if fallback is None:
                raise
            spec, source = fallback()
            cur = d.get("default", {}).get("current", {})
            try:  # (the record's shape was checked up to its document)
                revision = int_field(cur, "revision", path=f"{path}.default.current", lo=1) + 1
            except SnapshotError:
                revision = 1
            dropped.append(f"{e}; the configured default policy {spec.name!r} serves instead")
            default = _Slot(PolicyRecord(spec, revision, source, clock()), deque(maxlen=history))
        store = cls(default=default.current.spec, source=default.current.source, clock=clock, history=history)
        store._default = default
        for eid, s in mapping_field(d, "engines", path=path).items():
            at = f"{path}.engines[{eid!r}]"
            try:
                if not eid or len(eid) > MAX_ENGINE_ID or has_control(eid):
                    raise SnapshotError(f"{at}: not an engine id")
                own = slot(s, at)
                # the key decides which engine runs it, the record's id is what policy list shows
                if own.current.engine_id != eid:
                    raise SnapshotError(f"{at}: holds engine {own.current.engine_id!r}'s policy")
                store._engines[eid] = own
            except (SnapshotError, PolicyError) as e:
                dropped.append(f"{e}: the engine's own policy dropped (it follows the default)")
        return store


__all__ = ["NoPreviousPolicy", "PolicyError", "PolicyRecord", "PolicyStore"]
