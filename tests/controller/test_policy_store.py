from __future__ import annotations

import pytest

from controller.policy_store import NoPreviousPolicy, PolicyStore
from policies.presets import load_preset, preset_text
from policies.spec import PolicyError


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
