"""Saved control-loop statistics of the wrong shape, from the snapshot or the fleet's posteriors: the
sidecar still starts, the engine attaches at once (its loop starts afresh, its counters kept) and a
closed stream leaves it disconnected. In-process, no socket; the fleet link is a stub."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from controller.sidecar import Sidecar
from policies.directive import Directive
from tests.controller.test_sidecar_unit import Clock, batch, drain, info, make

Damage = Callable[[dict[str, Any]], None]


def _ctx(loop: dict[str, Any]) -> dict[str, Any]:
    ctx: dict[str, Any] = next(iter(loop["contexts"].values()))
    return ctx


DAMAGE: dict[str, Damage] = {
    "contexts-list": lambda loop: loop.update(contexts=[]),
    "guards-string": lambda loop: loop.update(guards="x"),
    "tpot-guard-list": lambda loop: loop["guards"].update(tpot=[1]),
    "learner-table-list": lambda loop: loop["learner"].update(acc=[]),
    "rounds-1e400": lambda loop: loop.update(rounds=float("inf")),
    "arm-index-99": lambda loop: _ctx(loop).update(arm=99),
    # Found by a hostile-input review: each loaded silently and failed later with an ERROR and a
    # traceback (or stayed in the learner and fed its decisions).
    "learner-batch-one-number": lambda loop: loop["learner"]["batch"].update(
        {next(iter(loop["learner"]["batch"])): [1.0]}
    ),
    "learner-acc-negative": lambda loop: loop["learner"]["acc"].update(
        {k: [[-1000.0] * len(r) for r in v] for k, v in loop["learner"]["acc"].items()}
    ),
    "learner-xtx-zero": lambda loop: loop["learner"].update(xtx=[[0.0] * 6 for _ in range(6)]),
    "learner-acc-method-99": lambda loop: loop["learner"]["acc"].update(
        {"chat|99": next(iter(loop["learner"]["acc"].values()))}
    ),
}
#: In a snapshot, counters out of range drop the whole engine entry (tests/reliability); the fleet's
#: counters are never taken, but a document with them broken is not used either.
FLEET_DAMAGE = DAMAGE | {"totals-steps-null": lambda loop: loop["totals"].update(steps=None)}


def _learned(tmp_path: Path, clock: Clock) -> Path:
    """A stopped sidecar (default policy) whose engine e1 learned for a while: its snapshot."""
    sc = make(tmp_path, clock)
    sc.open()
    s = sc.attach(info("e1"), instance_id="1" * 32)
    for seq in range(1, 40):
        sc.ingest(s, batch(seq, 8, t0=float(seq)))
        clock.now += 1.0
        sc.tick()
    sc.detach(s)
    sc.close(snapshot=True)
    assert sc.snapshots.path.exists()
    return sc.snapshots.path


def _attach_and_leave(sc: Sidecar, eid: str) -> None:
    s = sc.attach(info(eid), instance_id="2" * 32)
    assert any(isinstance(d, Directive) for d in drain(s.queue))
    sc.detach(s)
    assert not sc.engines()[eid].connected


@pytest.mark.parametrize("damage", list(DAMAGE.values()), ids=list(DAMAGE))
def test_a_snapshot_loop_of_the_wrong_shape_starts_that_loop_afresh(
    tmp_path: Path, damage: Damage, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    path = _learned(tmp_path, clock)
    doc = json.loads(path.read_text())
    steps = doc["state"]["engines"]["e1"]["loop"]["totals"]["steps"]
    damage(doc["state"]["engines"]["e1"]["loop"])
    # JSON has no infinity; a number beyond a double's range reads as one (the snapshot refuses the
    # Infinity constant as a whole).
    path.write_text(json.dumps(doc).replace("Infinity", "1e400"))
    caplog.set_level(logging.WARNING)
    sc = make(tmp_path, clock)
    sc.open()  # twice in a row would crash-loop before: it must start
    try:
        st = sc.engines()["e1"]
        assert st.loop.totals.steps == steps  # the counters are the snapshot's own, kept
        assert st.loop.rounds == 0  # the statistics: afresh
        assert "statistics not restored" in caplog.text
        _attach_and_leave(sc, "e1")
    finally:
        sc.close(snapshot=False)


class _Fleet:
    """What the sidecar reads of a fleet link here: the posteriors one model's engines share."""

    def __init__(self, posteriors: dict[str, Any]) -> None:
        self.posteriors = posteriors

    def latest_posteriors(self, model: str) -> dict[str, Any] | None:
        return self.posteriors if model == "tiny" else None

    def publish_state(self, *a: Any, **kw: Any) -> None:
        pass


@pytest.mark.parametrize("damage", list(FLEET_DAMAGE.values()), ids=list(FLEET_DAMAGE))
def test_fleet_posteriors_of_the_wrong_shape_are_not_used_and_the_engine_attaches(
    tmp_path: Path, damage: Damage, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    path = _learned(tmp_path / "donor", clock)
    shared = json.loads(path.read_text())["state"]["engines"]["e1"]["loop"]
    damage(shared)
    caplog.set_level(logging.INFO)
    sc = make(tmp_path / "fresh", clock)
    sc.open()
    sc.fleet = _Fleet(shared)  # type: ignore[assignment]
    try:
        for eid in ("new1", "new2"):  # a retained message: every new engine of the model reads it
            _attach_and_leave(sc, eid)
            assert sc.engines()[eid].loop.rounds == 1  # a fresh loop after its first decision
        assert "fleet posteriors for tiny not used" in caplog.text
    finally:
        sc.close(snapshot=False)


def test_good_fleet_posteriors_still_warm_start_a_new_engine(tmp_path: Path) -> None:
    clock = Clock()
    path = _learned(tmp_path / "donor", clock)
    shared = json.loads(path.read_text())["state"]["engines"]["e1"]["loop"]
    sc = make(tmp_path / "fresh", clock)
    sc.open()
    sc.fleet = _Fleet(shared)  # type: ignore[assignment]
    try:
        assert shared.get("decision")  # the donor had a directive in force
        _attach_and_leave(sc, "new1")
        loop = sc.engines()["new1"].loop
        # the learned tables, not the donor's round in progress or directive: a round ran at attach
        assert loop.rounds == shared["rounds"] + 1 and loop.totals.steps == 0
    finally:
        sc.close(snapshot=False)
