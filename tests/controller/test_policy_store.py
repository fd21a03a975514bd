from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.policy_store import NoPreviousPolicy, PolicyStore
from controller.snapshot import SnapshotError
from policies.presets import load_preset, preset_text
from policies.spec import PolicyError, PolicySpec


def make() -> PolicyStore:
    return PolicyStore(default=load_preset("default"), source="preset:default", clock=lambda: 5.0)


def test_set_and_rollback_default() -> None:
    s = make()
    assert (s.default.spec.name, s.default.revision) == ("default", 1)
    r = s.set(preset_text("static-off"), source="static-off")
    assert (r.spec.name, r.revision, r.source, r.set_at_s) == ("static-off", 2, "static-off", 5.0)
    s.set(preset_text("static-ngram-4"), source="ngram")
    assert [h.spec.name for h in s.history()] == ["static-off", "default"]
    back = s.rollback()
    assert (back.spec.name, back.revision) == ("static-off", 4)
    back = s.rollback()
    assert (back.spec.name, back.revision) == ("default", 5)
    with pytest.raises(NoPreviousPolicy):
        s.rollback()
    assert (s.default.spec.name, s.default.revision) == ("default", 5)


def test_broken_policy_changes_nothing() -> None:
    s = make()
    broken = preset_text("static-off").replace("min_dwell_s: 0.0", "min_dwell_s: fast")
    with pytest.raises(PolicyError) as e:
        s.set(broken, source="bad.yaml")
    assert str(e.value).startswith("bad.yaml:13: spec.min_dwell_s: ")
    assert (s.default.spec.name, s.default.revision) == ("default", 1)
    assert s.history() == []


def test_engine_overrides() -> None:
    s = make()
    s.set(preset_text("static-off"), source="off", engine_id="e1")
    assert s.effective("e1").spec.name == "static-off"
    assert s.effective("e2").spec.name == "default"
    assert list(s.overrides()) == ["e1"]
    s.set(preset_text("static-ngram-4"), source="ng", engine_id="e1")
    assert (s.effective("e1").spec.name, s.effective("e1").revision) == ("static-ngram-4", 2)
    assert s.rollback("e1").spec.name == "static-off"
    # The last rollback of an override removes it: the engine follows the default again.
    assert s.rollback("e1").spec.name == "default"
    assert s.overrides() == {}
    with pytest.raises(NoPreviousPolicy):
        s.rollback("e1")


def test_json_round_trip() -> None:
    s = make()
    s.set(preset_text("static-off"), source="off")
    s.set(preset_text("epsilon-greedy"), source="eg", engine_id="e1")
    t = PolicyStore.from_json(s.to_json())
    assert t.to_json() == s.to_json()
    assert (t.default.spec, t.default.revision) == (s.default.spec, 2)
    assert t.effective("e1").spec.name == "epsilon-greedy"
    assert [h.spec.name for h in t.history()] == ["default"]


def test_history_is_bounded() -> None:
    s = PolicyStore(default=load_preset("default"), source="d", history=3)
    for _ in range(10):
        s.set(preset_text("static-off"), source="off")
    assert len(s.history()) == 3
    assert s.default.revision == 11


def test_a_saved_policy_an_older_version_accepted_still_restores() -> None:
    # slo.min_samples above slo.window is refused for new documents since; a snapshot holding one
    # (window 32 with the default min_samples of 64) must still restore, not be moved aside.
    text = preset_text("static-off").replace("spec:\n", "spec:\n  slo: {p99_tpot_ms: 40, window: 32}\n", 1)
    with pytest.raises(PolicyError, match=r"spec\.slo\.min_samples"):
        make().set(text, source="new")
    saved = make().to_json()
    saved["default"]["current"]["yaml"] = text
    restored = PolicyStore.from_json(saved)
    assert restored.default.spec.slo["window"] == 32


# -- restoring around refused documents: nothing valid is lost, each drop is named --------------

NAMES = ["ucb1", "thompson", "static-off", "static-ngram-4", "epsilon-greedy", "hedge", "sw-ucb"]


def configured() -> tuple[PolicySpec, str]:
    return load_preset("static-eagle3-3"), "preset:static-eagle3-3"


def saved(n: int, engine_id: str = "") -> dict[str, Any]:
    """A snapshot's policies after ``n`` sets (revisions 1..n+1 for the default, 1..n for an override)."""
    s = make()
    for name in NAMES[:n]:
        s.set(preset_text(name), source=f"preset:{name}", engine_id=engine_id)
    return copy.deepcopy(s.to_json())


def refuse(record: dict[str, Any]) -> None:
    """What a newer version's rule does to a document: this version refuses it."""
    record["yaml"] = record["yaml"].replace(
        "apiVersion: speccontrol/v1", "apiVersion: speccontrol/v1\nfuture_rule: 1", 1
    )


def restore(d: dict[str, Any]) -> tuple[PolicyStore, list[str]]:
    problems: list[str] = []
    return PolicyStore.from_json(d, clock=lambda: 9.0, problems=problems, fallback=configured), problems


def test_a_refused_default_keeps_its_valid_history_and_rollback_reaches_it() -> None:
    d = saved(3)  # current: static-off at 4; history: default 1, ucb1 2, thompson 3
    refuse(d["default"]["current"])
    s, problems = restore(d)
    assert (s.default.spec.name, s.default.revision) == ("static-eagle3-3", 5)  # after every saved one
    assert [(h.spec.name, h.revision) for h in s.history()] == [("thompson", 3), ("ucb1", 2), ("default", 1)]
    (line,) = problems  # one thing dropped: the refused document, named by path and reason
    assert line.startswith(
        "policies.default.current refused, the configured default policy 'static-eagle3-3'"
    )
    assert "3 earlier revisions kept for rollback, the newest 3" in line and "future_rule" in line
    back = s.rollback()
    assert (back.spec.name, back.revision, back.source) == ("thompson", 6, "preset:thompson")
    # and the next restart still has them (the snapshot written at start must not lose them)
    again, problems = restore(s.to_json())
    assert problems == [] and again.to_json() == s.to_json()


def test_bad_history_entries_are_dropped_each_by_name_and_the_rest_kept() -> None:
    d = saved(4)  # history: default 1, ucb1 2, thompson 3, static-off 4
    h = d["default"]["history"]
    refuse(h[1])
    h[2]["set_at_s"] = "yesterday"
    h.append("not a record")
    s, problems = restore(d)
    assert (s.default.spec.name, s.default.revision) == ("static-ngram-4", 5)
    assert [h.revision for h in s.history()] == [4, 1]
    assert [p.split(" dropped: ")[0] for p in problems] == [
        "policies.default.history[1] (revision 2)",
        "policies.default.history[2] (revision 3)",
        "policies.default.history[4]",
    ]
    assert "future_rule" in problems[0] and "set_at_s" in problems[1]


def test_a_refused_default_with_bad_history_entries_keeps_the_good_ones() -> None:
    d = saved(3)
    refuse(d["default"]["current"])
    refuse(d["default"]["history"][2])  # thompson at 3
    d["default"]["current"]["revision"] = "six"  # unreadable: the history still numbers what follows
    s, problems = restore(d)
    assert s.default.revision == 3
    assert [h.revision for h in s.history()] == [2, 1]
    assert len(problems) == 2 and problems[0].startswith("policies.default.history[2] (revision 3) dropped: ")
    assert s.rollback().spec.name == "ucb1"


def test_a_refused_override_follows_the_default_and_keeps_its_history() -> None:
    d = saved(3, engine_id="e1")  # e1: ucb1 1, thompson 2, static-off 3 (current)
    refuse(d["engines"]["e1"]["current"])
    s, problems = restore(d)
    assert s.overrides() == {} and s.effective("e1") == s.default
    assert [h.revision for h in s.history("e1")] == [2, 1]
    (line,) = problems
    assert line.startswith("policies.engines['e1'].current refused, the engine's own policy dropped")
    assert "2 earlier revisions kept for rollback" in line
    # kept across another restart (and an older version drops the entry as it dropped the override)
    again, problems = restore(s.to_json())
    assert problems == [] and again.to_json() == s.to_json() and again.overrides() == {}
    back = again.copy().rollback("e1")
    assert (back.spec.name, back.revision, back.engine_id) == ("thompson", 4, "e1")
    # a new override continues the numbering, with the kept revisions as its history
    rec = again.set(preset_text("hedge"), source="h", engine_id="e1")
    assert rec.revision == 4 and [h.revision for h in again.history("e1")] == [2, 1]
    assert again.rollback("e1").spec.name == "thompson"


def test_a_refused_override_with_no_valid_history_is_dropped_as_before() -> None:
    d = saved(1, engine_id="e1")
    refuse(d["engines"]["e1"]["current"])
    s, problems = restore(d)
    assert s.overrides() == {} and s.history("e1") == [] and len(problems) == 1
    assert "e1" not in s.to_json()["engines"]
    with pytest.raises(NoPreviousPolicy):
        s.rollback("e1")


@given(
    n=st.integers(1, len(NAMES)),
    bad=st.sets(st.integers(0, len(NAMES) - 1)),
    how=st.sampled_from(["document", "shape", "type"]),
    current=st.sampled_from([None, "document", "field", "owner", "type"]),
    engine=st.booleans(),
)
def test_exactly_the_valid_entries_survive_in_order_and_revisions_only_grow(
    n: int, bad: set[int], how: str, current: str | None, engine: bool
) -> None:
    # The current record refused by its document (a rule added since), or by a field of it of the
    # wrong type (which dropped the valid history with it, and the next revision went back to 1).
    eid = "e1" if engine else ""
    d = saved(n, engine_id=eid)
    slot = d["engines"]["e1"] if engine else d["default"]
    history = slot["history"]
    bad = {i for i in bad if i < len(history)}
    for i in bad:
        if how == "document":
            refuse(history[i])
        elif how == "shape":
            history[i]["revision"] = -1
        else:
            history[i] = [history[i]]
    saved_max = slot["current"]["revision"]
    if current == "document":
        refuse(slot["current"])
    elif current == "field":
        slot["current"]["set_at_s"] = ""
    elif current == "owner":
        del slot["current"]["engine_id"]
        slot["current"]["set_at_s"] = ""
    elif current == "type":
        slot["current"] = [slot["current"]]
    if current not in (None, "document") and not engine:  # the default's record is the store's root
        with pytest.raises(SnapshotError, match=r"^policies\.default\.current"):
            restore(d)
        return
    want = [r["revision"] for i, r in enumerate(history) if i not in bad]

    s, problems = restore(d)
    assert len(problems) == len(bad) + bool(current)  # every entry dropped is counted, each on its own line
    assert [h.revision for h in s.history(eid)] == list(reversed(want))
    if engine and current:
        assert eid not in s.overrides()
    else:
        got = s.get(eid)
        if current == "type":  # its revision unreadable too: past every valid entry's
            assert got.revision > max(want, default=0)
        else:
            assert got.revision >= saved_max and (got.revision > saved_max) == bool(current)
    # rolling back walks the valid entries newest first, each at a higher revision than the last
    last = saved_max if current != "type" else max(want, default=0)
    for r in reversed(want):
        back = s.rollback(eid)
        assert back.revision > last and back.source == next(
            h["source"] for h in history if isinstance(h, dict) and h.get("revision") == r
        )
        last = back.revision


def test_an_override_a_rollback_removed_and_set_again_goes_on_numbering_across_restores() -> None:
    """Revisions of an engine's policy never repeat: an override removed by its last rollback and set
    again started at revision 1 again (two different policies were "revision 1 for engine e1")."""
    s = make()
    s.set(preset_text("static-off"), source="a", engine_id="e1")
    s.set(preset_text("hedge"), source="b", engine_id="e1")
    assert s.rollback("e1").revision == 3
    removed = s.rollback("e1")  # no earlier revision: the override goes, e1 follows the default
    assert removed == s.default and s.overrides() == {} and s.history("e1") == []
    with pytest.raises(NoPreviousPolicy):
        s.copy().rollback("e1")
    again, problems = restore(s.to_json())  # a restart between the removal and the next set
    assert problems == [] and again.overrides() == {} and again.history("e1") == []
    for store in (s, again):
        rec = store.set(preset_text("ucb1"), source="c", engine_id="e1")
        assert (rec.revision, rec.engine_id) == (4, "e1")
        assert store.history("e1") == []
    assert make().set(preset_text("ucb1"), source="c", engine_id="e2").revision == 1  # others start at 1


def test_engines_whose_override_was_removed_are_remembered_boundedly() -> None:
    from controller.policy_store import MAX_REMOVED

    s = make()
    for i in range(MAX_REMOVED + 5):
        s.set(preset_text("static-off"), source="a", engine_id=f"e{i}")
        s.rollback(f"e{i}")
    engines = s.to_json()["engines"]
    assert len(engines) == MAX_REMOVED and "e0" not in engines and f"e{MAX_REMOVED + 4}" in engines
    assert s.set(preset_text("hedge"), source="b", engine_id="e0").revision == 1  # forgotten: from 1
    assert s.set(preset_text("hedge"), source="b", engine_id="e9").revision == 2


@pytest.mark.parametrize(
    ("where", "value"),
    [("history", {"0": {}}), ("history", None), ("history", "x"), ("engines", []), ("engines", "e1")],
)
def test_a_history_or_overrides_table_of_the_wrong_type_is_dropped_alone(where: str, value: object) -> None:
    """It raised, and the whole snapshot was moved aside with it: the current default policy, its
    revision (the next was 1 again), every engine and the directive version counter."""
    d = saved(3)  # default: static-off at 4, history 1-3
    d["engines"] = saved(2, engine_id="e1")["engines"]
    if where == "history":
        d["default"]["history"] = value
    else:
        d["engines"] = value
    s, problems = restore(d)
    (line,) = problems
    assert (s.default.spec.name, s.default.revision) == ("static-off", 4)
    if where == "history":
        assert line.startswith("policies.default.history: expected a list") and "history dropped" in line
        assert s.history() == [] and s.effective("e1").revision == 2
        assert s.set(preset_text("hedge"), source="h").revision == 5
    else:
        assert line.startswith("policies.engines: expected an object") and s.overrides() == {}
        assert [h.revision for h in s.history()] == [3, 2, 1]
