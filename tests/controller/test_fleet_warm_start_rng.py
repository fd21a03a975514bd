"""A fleet warm start shares what the donor learned, never its random stream.

What must hold: engines warm-started from one donor's posteriors (``speccontrol/v1/<fleet>/posteriors``)
take its learned tables, but each draws from a stream of its own, derived from the policy's seed and
its own engine id: two replicas warm-started from one donor explored identically before (each took
the donor's RNG state, so the same draws on the same tables: correlated exploration across the
fleet). The same engine warm-started from the same donor draws the same numbers (runs reproduce).
In-process, no socket; the fleet link is a stub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.sidecar import Sidecar
from policies.loop import ControlLoop
from policies.presets import preset_text
from policies.spec import parse_policy
from tests.controller.test_sidecar_saved_loops import _attach_and_leave, _Fleet, _learned
from tests.controller.test_sidecar_unit import Clock, info, make


def _donor(tmp_path: Path) -> dict[str, Any]:
    """The posteriors a donor engine (e1, default policy) shares after learning for a while."""
    path = _learned(tmp_path / "donor", Clock())
    loop: dict[str, Any] = json.loads(path.read_text())["state"]["engines"]["e1"]["loop"]
    return loop


def _warm(tmp_path: Path, shared: dict[str, Any], *engine_ids: str) -> Sidecar:
    """A fresh sidecar whose fleet holds ``shared``, with ``engine_ids`` attached (and left)."""
    sc = make(tmp_path, Clock())
    sc.open()
    sc.fleet = _Fleet(shared)  # type: ignore[assignment]
    for eid in engine_ids:
        _attach_and_leave(sc, eid)
    return sc


def test_two_engines_warm_started_from_one_donor_draw_from_streams_of_their_own(tmp_path: Path) -> None:
    shared = _donor(tmp_path)
    a = _warm(tmp_path / "a", shared, "new1")
    b = _warm(tmp_path / "b", shared, "new2")
    try:
        la, lb = a.engines()["new1"].loop, b.engines()["new2"].loop
        # The posteriors are shared: the same learned tables, warm (the donor's rounds and more).
        assert la.state_dict()["learner"] == lb.state_dict()["learner"]
        assert la.rounds == lb.rounds == shared["rounds"] + 1
        # The random streams are not: not the donor's, not each other's.
        assert la.state_dict()["rng"] != shared["rng"] and lb.state_dict()["rng"] != shared["rng"]
        assert la.state_dict()["rng"] != lb.state_dict()["rng"]
        assert not np.array_equal(la.rng.random(16), lb.rng.random(16))
    finally:
        a.close(snapshot=False)
        b.close(snapshot=False)


def test_the_same_engine_warm_started_from_the_same_donor_draws_the_same_numbers(tmp_path: Path) -> None:
    shared = _donor(tmp_path)
    a = _warm(tmp_path / "a", shared, "new1")
    b = _warm(tmp_path / "b", shared, "new1")
    try:
        assert a.engines()["new1"].loop.state_dict() == b.engines()["new1"].loop.state_dict()
    finally:
        a.close(snapshot=False)
        b.close(snapshot=False)


@settings(max_examples=25, deadline=None)
@given(own=st.integers(0, 2**32 - 1), donor=st.integers(0, 2**32 - 1))
def test_load_learned_keeps_the_loops_own_random_stream(own: int, donor: int) -> None:
    spec = parse_policy(preset_text("default"), source="default")
    giver = ControlLoop(spec=spec, engine=info("donor"), seed=donor)
    giver.rng.random(3)  # the donor's stream has moved on
    taker = ControlLoop(spec=spec, engine=info("taker"), seed=own)
    fresh = ControlLoop(spec=spec, engine=info("taker"), seed=own)
    taker.load_learned(giver.state_dict())
    assert taker.rng.bit_generator.state == fresh.rng.bit_generator.state
