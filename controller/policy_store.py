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

from policies.spec import PolicyError, PolicySpec, parse_policy, render_policy

HISTORY = 20


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
    def from_json(cls, d: Mapping[str, Any]) -> PolicyRecord:
        source = str(d.get("source", "<snapshot>"))
        return cls(
            parse_policy(str(d["yaml"]), source=source),
            int(d["revision"]),
            source,
            float(d["set_at_s"]),
            str(d.get("engine_id", "")),
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
        cls, d: Mapping[str, Any], *, clock: Callable[[], float] = time.time, history: int = HISTORY
    ) -> PolicyStore:
        """Raises PolicyError/KeyError/ValueError for a state that cannot be restored."""

        def slot(s: Mapping[str, Any]) -> _Slot:
            return _Slot(
                PolicyRecord.from_json(s["current"]),
                deque((PolicyRecord.from_json(r) for r in s["history"]), maxlen=history),
            )

        default = slot(d["default"])
        store = cls(default=default.current.spec, source=default.current.source, clock=clock, history=history)
        store._default = default
        store._engines = {str(e): slot(s) for e, s in d["engines"].items()}
        return store


__all__ = ["NoPreviousPolicy", "PolicyError", "PolicyRecord", "PolicyStore"]
