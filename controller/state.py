"""The sidecar's saved state: what a snapshot holds, written out and read back checked.

What must hold: ``state_to_json`` writes the policies, the directive version counter, the fleet policy
version and per engine its description, control-loop state, counters and report sequence; ``parse_state``
checks every value read back (a field path names any bad one). A snapshot whose policies or counters are
unusable raises (the caller moves the file aside and starts clean), and so does a configured default
policy that cannot be loaded where it must stand in (the file is then left where it is: the config is
at fault); a bad engine entry is dropped alone and named in ``problems``, the rest is kept. After a
crash the version counter skips ahead by ``CRASH_VERSION_GAP`` so directives stay strictly increasing. No I/O here but through ``SnapshotStore``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.policy_store import PolicyStore
from controller.snapshot import (
    MAX_COUNT,
    SnapshotError,
    SnapshotStore,
    int_field,
    mapping_field,
    str_field,
)
from controller.v1 import controller_pb2 as pb
from controller.validation import (
    MAX_INSTANCE_ID,
    TelemetryError,
    validate_hello,
)
from controller.wire.codec import MAX_SEQUENCE
from controller.wire.convert import arm_to_pb
from controller.wire.names import MAX_TRAFFIC_CLASS, escape_text, has_control
from policies.arms import Arm
from policies.classes import MAX_CLASSES_PER_ENGINE
from policies.engine import EngineInfo
from policies.loop import Totals
from policies.spec import PolicyError, PolicySpec

log = logging.getLogger(__name__)

#: A clean shutdown saves the exact version counter; after a crash the last periodic snapshot may be
#: behind what was sent, so the counter skips ahead by this much to stay strictly increasing.
CRASH_VERSION_GAP = 1_000_000


def oneline(text: str, limit: int = 300) -> str:
    """Text for one log line: control characters escaped, length bounded."""
    return escape_text(text)[:limit]


def info_to_json(e: EngineInfo) -> dict[str, Any]:
    return {
        "engine_id": e.engine_id,
        "model": e.model,
        "max_k": e.max_k,
        "arms": [str(a) for a in e.arms],
        "granularity": int(e.granularity),
        "max_batch_size": e.max_batch_size,
        "counterfactual_methods": [m.value for m in e.counterfactual_methods],
        "p_eagle_partial_k_safe": e.p_eagle_partial_k_safe,
    }


#: The type of each field of a saved engine description: protobuf takes a number for a bool (-1 as
#: true), None for unset (a model "", the default batch size) and raises OverflowError for a bool
#: beyond a C long, which no handler took: the sidecar did not start on such a snapshot.
_INFO_TYPES: dict[str, type] = {
    "engine_id": str,
    "model": str,
    "max_k": int,
    "arms": list,
    "granularity": int,
    "max_batch_size": int,
    "counterfactual_methods": list,
    "p_eagle_partial_k_safe": bool,
}


def info_from_json(d: Mapping[str, Any]) -> EngineInfo:
    """An engine description from a snapshot, checked as its Hello was. Raises TelemetryError or
    SnapshotError."""
    for key, kind in _INFO_TYPES.items():
        v = d.get(key)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise SnapshotError(f"info.{key}: expected {kind.__name__}, got {type(v).__name__}")
    try:
        hello = pb.Hello(
            engine_id=d["engine_id"],
            model=d["model"],
            max_k=d["max_k"],
            arms=[arm_to_pb(Arm.parse(a)) for a in d["arms"]],
            granularity=d["granularity"],
            max_batch_size=d["max_batch_size"],
            counterfactual_methods=d["counterfactual_methods"],
            p_eagle_partial_k_safe=d["p_eagle_partial_k_safe"],
            protocol_version=1,
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise SnapshotError(f"info: {type(e).__name__}: {e}") from None
    return validate_hello(hello)


def totals_from_json(d: Mapping[str, Any], *, path: str) -> Totals:
    """A loop's lifetime counters from a snapshot, each in range. Raises SnapshotError."""
    try:
        return Totals.from_json(d, path=path)
    except ValueError as e:
        raise SnapshotError(str(e)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedEngine:
    """One engine as a snapshot holds it, every field checked."""

    info: EngineInfo
    #: The control loop's ``state_dict`` (loaded only when its policy is still the engine's).
    loop: Mapping[str, Any]
    totals: Totals
    rejected: int = 0
    instance_id: str = ""
    last_sequence: int = 0
    #: The traffic classes the engine's loop learns about (the bound on them must hold across
    #: restarts); empty in snapshots written before they were kept.
    classes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "info": info_to_json(self.info),
            "loop": dict(self.loop),
            "rejected": self.rejected,
            "instance_id": self.instance_id,
            "last_sequence": self.last_sequence,
            "classes": sorted(self.classes),
        }

    @classmethod
    def from_json(cls, eid: str, e: Any, *, path: str) -> SavedEngine:
        """Raises SnapshotError or TelemetryError naming ``path``."""
        if not isinstance(e, Mapping):
            raise SnapshotError(f"{path}: expected an object, got {type(e).__name__}")
        info = info_from_json(mapping_field(e, "info", path=path))
        if info.engine_id != eid:
            raise SnapshotError(f"{path}.info.engine_id: {info.engine_id!r} is not the entry's id")
        loop = mapping_field(e, "loop", path=path)
        return cls(
            info=info,
            loop=loop,
            totals=totals_from_json(
                mapping_field(loop, "totals", path=f"{path}.loop"), path=f"{path}.loop.totals"
            ),
            rejected=int_field(e, "rejected", path=path, default=0),
            instance_id=str_field(
                e, "instance_id", path=path, max_len=MAX_INSTANCE_ID, default="", name=True
            ),
            last_sequence=int_field(e, "last_sequence", path=path, hi=MAX_SEQUENCE, default=0),
            classes=_classes_field(e, path=path),
        )


def _classes_field(e: Mapping[str, Any], *, path: str) -> tuple[str, ...]:
    v = e.get("classes", [])
    if not isinstance(v, list):
        raise SnapshotError(f"{path}.classes: expected a list, got {type(v).__name__}")
    if len(v) > MAX_CLASSES_PER_ENGINE:
        raise SnapshotError(
            f"{path}.classes: {len(v)} classes, more than the {MAX_CLASSES_PER_ENGINE} an engine has"
        )
    for i, c in enumerate(v):
        at = f"{path}.classes[{i}]"
        if not isinstance(c, str):
            raise SnapshotError(f"{at}: expected a string, got {type(c).__name__}")
        if len(c) > MAX_TRAFFIC_CLASS:
            raise SnapshotError(f"{at}: longer than {MAX_TRAFFIC_CLASS} characters")
        if has_control(c):
            raise SnapshotError(f"{at}: holds control characters ({escape_text(c)[:80]})")
    # The engine's classes are these and "default" (``_engine_from_saved``): one over the bound was
    # restored, written back, and refused by the restart after, which dropped the engine.
    if len({"default", *v}) > MAX_CLASSES_PER_ENGINE:
        raise SnapshotError(
            f"{path}.classes: {len(v)} classes besides 'default', more than the "
            f"{MAX_CLASSES_PER_ENGINE} an engine has with it"
        )
    return tuple(v)


@dataclass(slots=True, kw_only=True)
class SavedState:
    """The sidecar's state as a snapshot holds it."""

    policies: PolicyStore
    #: The directive version counter to continue from (already past ``CRASH_VERSION_GAP`` after a crash).
    directive_version: int
    fleet_policy_version: int = 0
    #: SHA-256 of the applied fleet policy's YAML ("" = unknown: a snapshot from before it was kept).
    fleet_policy_digest: str = ""
    engines: dict[str, SavedEngine] = field(default_factory=dict)
    #: One line per entry dropped on load.
    problems: list[str] = field(default_factory=list)


def state_to_json(
    *,
    policies: PolicyStore,
    directive_version: int,
    fleet_policy_version: int,
    fleet_policy_digest: str = "",
    engines: Mapping[str, SavedEngine],
    clean: bool,
) -> dict[str, Any]:
    return {
        "directive_version": directive_version,
        "fleet_policy_version": fleet_policy_version,
        "fleet_policy_digest": fleet_policy_digest,
        "clean": clean,
        "policies": policies.to_json(),
        "engines": {eid: e.to_json() for eid, e in engines.items()},
    }


def _digest_field(state: Mapping[str, Any], problems: list[str]) -> str:
    d = state.get("fleet_policy_digest", "")
    if isinstance(d, str) and (d == "" or (len(d) == 64 and all(c in "0123456789abcdef" for c in d))):
        return d
    problems.append("state.fleet_policy_digest: expected a SHA-256 hex digest; dropped (treated as unknown)")
    return ""


def _fleet_version_field(state: Mapping[str, Any], problems: list[str]) -> int:
    try:
        return int_field(state, "fleet_policy_version", path="state", default=0)
    except SnapshotError as e:  # the next retained fleet policy is then taken as new
        problems.append(f"{e}; dropped (treated as no fleet policy applied)")
        return 0


def parse_state(
    state: Mapping[str, Any],
    *,
    clock: Callable[[], float] = time.time,
    fallback: Callable[[], tuple[PolicySpec, str]] | None = None,
) -> SavedState:
    """Raises SnapshotError/PolicyError when the snapshot as a whole is unusable; a bad engine entry,
    override or history entry is dropped and named in ``problems``, and so is a default policy this
    version refuses where ``fallback`` gives the one to serve instead (``PolicyStore.from_json``)."""
    problems: list[str] = []
    store = PolicyStore.from_json(
        mapping_field(state, "policies", path="state"), clock=clock, problems=problems, fallback=fallback
    )
    saved = int_field(state, "directive_version", path="state", hi=MAX_COUNT - CRASH_VERSION_GAP)
    out = SavedState(
        policies=store,
        directive_version=saved if state.get("clean") is True else saved + CRASH_VERSION_GAP,
        fleet_policy_version=_fleet_version_field(state, problems),
        fleet_policy_digest=_digest_field(state, problems),
        problems=problems,
    )
    engines = state.get("engines", {})
    if not isinstance(engines, Mapping):
        problems.append(
            f"state.engines: expected an object, got {type(engines).__name__}; no engine restored"
        )
        engines = {}
    for eid, e in engines.items():
        at = f"state.engines[{eid!r}]"
        try:
            out.engines[eid] = SavedEngine.from_json(eid, e, path=at)
        except (SnapshotError, PolicyError, TelemetryError, ValueError) as err:
            problems.append(f"{at}: {err}; engine dropped")
    return out


def load_state(
    snapshots: SnapshotStore,
    *,
    clock: Callable[[], float] = time.time,
    fallback: Callable[[], tuple[PolicySpec, str]] | None = None,
) -> SavedState | None:
    """The state the snapshot file holds, or None when there is none or it cannot be restored as a
    whole (the file is then moved aside). A PolicyError of ``fallback`` itself (the configured default
    policy cannot be loaded) is raised as it is, with the file left in place: the config is at fault,
    not the snapshot (moved aside as corrupt, the start after the config was mended was clean)."""
    state = snapshots.load()
    if state is None:
        return None
    configured: list[PolicyError] = []

    def configured_default() -> tuple[PolicySpec, str]:
        assert fallback is not None
        try:
            return fallback()
        except PolicyError as e:
            configured.append(e)
            raise

    try:
        return parse_state(state, clock=clock, fallback=configured_default if fallback else None)
    except (PolicyError, SnapshotError) as e:
        if configured:
            raise configured[0] from None
        snapshots.quarantine(f"cannot be restored: {oneline(str(e))}")
        return None


def report_problems(snapshots: SnapshotStore, problems: list[str]) -> None:
    """Log each entry dropped on restore and keep a copy of the original file (the next write replaces it)."""
    for p in problems:
        log.warning("snapshot %s: %s", snapshots.path, oneline(p))
    if problems:
        snapshots.keep_copy(f"{len(problems)} entries dropped on restore")
