"""A snapshot's policy revisions out of order or repeated (a hand-edited or corrupt file) are refused
on restore, by the store's rule for anything bad in a snapshot, each naming its field path.

What must hold after a restore: each policy's history is in strictly increasing revision order and
every entry is before the current record's revision, so ``policy rollback`` returns to the newest
earlier revision and a new revision never repeats or goes below one saved. Before, a history of
revisions [1, 3, 2] rolled back to revision 2's policy (not 3's), and a current record at revision 2
with revision 3 in its history gave the next ``policy set`` revision 3 again.

The rule followed (``PolicyStore.from_json``): a history entry out of order is dropped alone (named);
a current record not after its history is a bad field of it: for the default policy the snapshot is
refused (SnapshotError: the sidecar moves the file aside), an engine's override is dropped (the engine
follows the default) with its valid history kept for rollback.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.snapshot import SnapshotError
from policies.presets import preset_text
from tests.controller.test_policy_store import restore, saved


def test_a_history_out_of_order_drops_the_entry_and_rollback_reaches_the_newest_revision() -> None:
    d = saved(3)  # current: static-off at 4; history: default 1, ucb1 2, thompson 3
    history = d["default"]["history"]
    history[1], history[2] = history[2], history[1]  # revisions 1, 3, 2
    s, problems = restore(d)
    assert problems == [
        "policies.default.history[2].revision: 2 is not after the revision before it (3); entry dropped"
    ]
    assert [(h.spec.name, h.revision) for h in s.history()] == [("thompson", 3), ("default", 1)]
    back = s.rollback()
    assert (back.spec.name, back.revision) == ("thompson", 5)


def test_a_repeated_history_revision_drops_the_second() -> None:
    d = saved(3)
    history = d["default"]["history"]
    history[2] = {**history[1], "source": "copy"}  # revisions 1, 2, 2
    s, problems = restore(d)
    assert problems == [
        "policies.default.history[2].revision: 2 is not after the revision before it (2); entry dropped"
    ]
    assert [h.revision for h in s.history()] == [2, 1]


def test_a_default_current_revision_not_after_its_history_refuses_the_snapshot() -> None:
    d = saved(3)
    d["default"]["current"]["revision"] = 3  # thompson in the history is revision 3 too
    with pytest.raises(SnapshotError) as e:
        restore(d)
    assert str(e.value) == (
        "policies.default.current.revision: 3 is not after the history's newest revision (3)"
    )


def test_an_override_current_revision_not_after_its_history_drops_the_override_and_keeps_its_history() -> (
    None
):
    d = saved(3, engine_id="e1")  # e1: current static-off at 3; history: ucb1 1, thompson 2
    d["engines"]["e1"]["current"]["revision"] = 1
    s, problems = restore(d)
    assert "e1" not in s.overrides()
    (line,) = problems
    assert line.startswith("policies.engines['e1'].current refused, the engine's own policy dropped")
    assert line.endswith(
        "policies.engines['e1'].current.revision: 1 is not after the history's newest revision (2)"
    )
    assert [h.revision for h in s.history("e1")] == [2, 1]
    again = s.set(preset_text("hedge"), source="again", engine_id="e1")
    assert again.revision == 3  # after every revision saved, none repeated


@given(
    revisions=st.lists(st.integers(1, 12), min_size=0, max_size=7),
    current=st.integers(1, 14),
    engine=st.booleans(),
)
def test_after_any_restore_revisions_increase_and_a_new_one_is_after_all_saved(
    revisions: list[int], current: int, engine: bool
) -> None:
    eid = "e1" if engine else ""
    d = saved(7, engine_id=eid)
    slot: dict[str, Any] = d["engines"]["e1"] if engine else d["default"]
    records = slot["history"] + [slot["current"]]
    slot["history"] = [{**records[i % len(records)], "revision": r} for i, r in enumerate(revisions)]
    slot["current"]["revision"] = current
    try:
        s, problems = restore(d)
    except SnapshotError as e:
        assert not engine and str(e).startswith("policies.default.current.revision: ")
        assert revisions and current <= max(revisions)
        return
    kept = [h.revision for h in reversed(s.history(eid))]  # oldest first
    assert kept == sorted(set(kept))  # strictly increasing
    served = s.get(eid).revision if eid in s.overrides() or not engine else None
    if served is not None:
        assert all(r < served for r in kept)
    # the entries dropped are each named, and only those out of order
    assert len(problems) == len(revisions) - len(kept) + (engine and served is None)
    new = s.set(preset_text("hedge"), source="new", engine_id=eid)
    assert new.revision > max([current, *kept])
