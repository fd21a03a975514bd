from dataclasses import replace

import numpy as np
import pytest

from controller.embedded.core import BINS, ENGINE_MODEL, EngineCore, EngineSettings
from controller.embedded.workload import Phase, Schedule, build_workload
from controller.wire.codec import observation_from_pb
from policies.arms import METHODS_BY_CODE, Arm, Method
from policies.directive import Directive
from policies.engine_rules import safe_default_directive
from sim.costmodel import DEFAULT_PROFILE, PluginCost, Profile, load_profile

PROFILE = load_profile(DEFAULT_PROFILE)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _core(
    clock: FakeClock | None = None,
    concurrency: int = 4,
    mix: dict[str, float] | None = None,
    plain: bool = False,
    profile: Profile = PROFILE,
) -> EngineCore:
    workload = build_workload(
        Schedule((Phase(5.0, mix or {"code-edit": 1.0}, concurrency),)), profile=profile, seed=1
    )
    return EngineCore(
        settings=EngineSettings(engine_id="e", plain=plain),
        workload=workload,
        profile=profile,
        clock=clock or FakeClock(),
    )


def _directive(arm: str, version: int, ttl_s: float = 10.0) -> Directive:
    return replace(
        safe_default_directive(Arm.parse(arm), max_k=16), version=version, policy="test", ttl_s=ttl_s
    )


def _arms(report) -> set[str]:  # type: ignore[no-untyped-def]
    obs = observation_from_pb(report)
    names = [METHODS_BY_CODE[c] for c in obs.method.tolist()]
    return {
        "off" if m is Method.OFF else f"{m.value}:{k}" for m, k in zip(names, obs.k.tolist(), strict=True)
    }


def test_runs_on_its_safe_default_until_a_directive_arrives() -> None:
    core = _core()
    core.step()  # prefill only
    rep = core.step()
    assert rep.directive_version == 0
    assert _arms(rep) == {"eagle3:3"}


def test_a_directive_takes_effect_at_the_next_step() -> None:
    core = _core()
    core.step()
    before = core.step()
    core.receive(_directive("ngram:2", 5))
    assert before.directive_version == 0  # the step already ran
    after = core.step()
    assert after.directive_version == 5
    assert _arms(after) == {"ngram:2"}


def test_k_is_clamped_to_max_k() -> None:
    core = _core()
    core.receive(_directive("eagle3:9", 1))
    core.step()
    obs = observation_from_pb(core.step())
    assert set(obs.k.tolist()) == {4}
    assert (obs.accepted <= 4).all()


def test_ttl_expiry_falls_back_to_the_safe_default_and_a_refresh_prevents_it() -> None:
    clock = FakeClock()
    core = _core(clock)
    core.receive(_directive("ngram:4", 3, ttl_s=1.0))
    core.step()
    clock.t += 0.8
    core.receive(_directive("ngram:4", 3, ttl_s=1.0))  # refresh, same version
    clock.t += 0.8
    rep = core.step()
    assert rep.directive_version == 3 and core.totals.fallbacks == 0
    clock.t += 1.5
    rep = core.step()
    assert rep.directive_version == 0
    assert _arms(rep) == {"eagle3:3"}
    assert core.totals.fallbacks == 1
    core.receive(_directive("ngram:4", 3, ttl_s=1.0))  # the sidecar is back: same decision again
    assert core.step().directive_version == 3


@pytest.mark.parametrize("ttl_s", [0.0, -1.0])
def test_a_ttl_of_zero_or_less_never_expires_as_in_the_plugin(ttl_s: float) -> None:
    # The vLLM plugin's link keeps such a directive for good (controller.vllm.link); the demo engine
    # fell back on the next step and took it again on every refresh, flapping between the two.
    clock = FakeClock()
    core = _core(clock)
    core.receive(_directive("ngram:4", 3, ttl_s=ttl_s))
    core.step()
    clock.t += 3600.0
    rep = core.step()
    assert rep.directive_version == 3 and _arms(rep) == {"ngram:4"}
    assert core.totals.fallbacks == 0


@pytest.mark.parametrize("duration_s", [1e-3, 0.05, 0.4, 4.0])
def test_goodput_over_time_covers_the_schedule_only(duration_s: float) -> None:
    # The last step ends past the schedule: bins after its end hold nothing (no step starts there),
    # showed as a drop to zero at the end of the plot, and numbered virtual_s / bin_s, millions for a
    # schedule shorter than one step (--seconds 1e-9 took minutes and gigabytes).
    workload = build_workload(Schedule((Phase(duration_s, {"chat": 1.0}, 32),)), profile=PROFILE, seed=2)
    core = EngineCore(settings=EngineSettings(engine_id="e"), workload=workload, profile=PROFILE)
    while not core.done:
        core.step()
    series = core.totals.goodput_over_time()
    assert core.totals.virtual_s > duration_s
    assert 0 < len(series) <= BINS
    assert all(t < duration_s for t, _ in series)
    if duration_s >= 4.0:  # steps far shorter than a bin (as in the demo): every bin, and no more
        assert len(series) == BINS


def test_stale_directives_are_ignored() -> None:
    core = _core()
    core.receive(_directive("ngram:4", 7))
    core.receive(_directive("off", 6))
    core.step()
    assert core.step().directive_version == 7
    assert core.totals.stale_directives == 1


def test_a_new_stream_takes_its_first_directive_whatever_its_version() -> None:
    # A sidecar that restarted without its state numbers from 1 again: every directive of the new
    # stream was dropped as stale and the engine ran the dead sidecar's directive on.
    core = _core()
    core.receive(_directive("ngram:4", 1_000_007))
    core.step()
    core.new_stream()
    core.receive(_directive("off", 1))
    core.step()
    assert core.step().directive_version == 1
    core.receive(_directive("eagle3:3", 2))
    core.step()
    assert core.step().directive_version == 2 and core.totals.stale_directives == 0


def test_counterfactual_ngram_on_every_row_not_verified_by_ngram() -> None:
    core = _core()
    core.step()
    obs = observation_from_pb(core.step())
    cf = obs.counterfactual[Method.NGRAM]
    assert obs.n and len(cf) == obs.n
    assert ((cf >= 0) & (cf <= 4)).all()
    core.receive(_directive("ngram:3", 1))
    obs = observation_from_pb(core.step())
    assert obs.n and Method.NGRAM not in obs.counterfactual


def test_closed_loop_keeps_concurrency_and_accounts_tokens() -> None:
    core = _core(concurrency=3)
    reports = [core.step() for _ in range(200)]
    assert all(r.batch_size == 3 for r in reports[1:])
    t = core.totals
    emitted = sum(o.emitted for o in map(observation_from_pb, reports))
    assert t.tokens == emitted + t.requests_started
    assert t.virtual_s == pytest.approx(sum(r.duration_s for r in reports))
    assert reports[-1].time_s == pytest.approx(t.virtual_s)
    assert t.requests_finished > 0


def test_same_seed_same_policy_same_result() -> None:
    a, b = _core(), _core()
    for c in (a, b):
        c.receive(_directive("eagle3:2", 1))
        while not c.done:
            c.step()
    assert a.totals.tokens == b.totals.tokens and a.totals.virtual_s == b.totals.virtual_s


def test_speculation_pays_at_batch_one_on_chat() -> None:
    res = {}
    for arm in ("off", "eagle3:3", "ngram:3"):
        c = _core(concurrency=1, mix={"chat": 1.0})
        c.receive(_directive(arm, 1))
        while not c.done:
            c.step()
        res[arm] = c.totals.goodput
    assert res["eagle3:3"] > 1.5 * res["off"]
    assert res["eagle3:3"] > res["ngram:3"]


@pytest.mark.parametrize(("arm", "concurrency"), [("eagle3:3", 1), ("ngram:2", 8), ("off", 32)])
def test_the_demo_engine_steps_are_the_simulators(arm: str, concurrency: int) -> None:
    """One engine model: the demo engine's step times equal the simulator's replay of its requests
    (a plain engine, as the demo's static baselines are: the vectorised replay prices static arms)."""
    from controller.embedded.core import PLAIN_MODEL
    from sim.vectorised import replay_static

    core = _core(concurrency=concurrency, mix={"maths": 1.0}, plain=True)
    core.receive(_directive(arm, 1))
    durations = []
    while not core.done:
        durations.append(core.step().duration_s)
    a = Arm.parse(arm)
    sim = replay_static(
        core.workload.trace,
        method=a.method,
        k=a.k,
        concurrency=concurrency,
        profile=PROFILE,
        engine=PLAIN_MODEL,
    )
    assert len(durations) > 100
    np.testing.assert_allclose(np.cumsum(durations), sim.timeline.end_s[: len(durations)], rtol=1e-12)


def test_a_controlled_engine_pays_the_plugin_and_a_plain_one_does_not() -> None:
    # Same requests, same static arm: the engine a controller drives pays the profile's plugin cost on
    # every step (the demo's adaptive engine), the plain vLLM (the demo's baselines) does not. Its
    # steps here do not wait (async scheduling, no n-gram rows), so the host's work (vLLM's and the
    # plugin's) overlaps the GPU's and shows only where it outlasts it: a plugin charge of 20-260 ms a
    # step outlasts every GPU step of this profile; the profile's own (0.2-0.3 ms) hides entirely.
    charge = PluginCost(step_s=0.02, per_request_s=0.03)
    durations = {}
    for plain, profile in ((True, PROFILE), (False, replace(PROFILE, plugin_composite=charge))):
        core = _core(concurrency=8, mix={"maths": 1.0}, plain=plain, profile=profile)
        core.receive(_directive("eagle3:3", 1))
        steps = [core.step() for _ in range(50)]
        durations[plain] = np.array([s.duration_s for s in steps])
        batch = np.array([len(s.columns.method) for s in steps], dtype=np.float64)
    assert ENGINE_MODEL.plugin_mode == "composite" and not ENGINE_MODEL.waits(False)
    # Steps that decode (both draft with EAGLE-3); a prefill-only step also differs by the head's
    # forward, which the composite drafter always runs and a plain vLLM does not.
    decode = batch > 0
    assert decode.sum() > 40 and (durations[True][decode] < charge.step_s).all()
    np.testing.assert_allclose(
        durations[False][decode], PROFILE.sync_step_s + charge.at(batch[decode]), rtol=1e-9
    )
    # At the profile's own charge the plugin hides behind these steps: the same durations.
    core = _core(concurrency=8, mix={"maths": 1.0}, plain=False)
    core.receive(_directive("eagle3:3", 1))
    same = np.array([core.step().duration_s for _ in range(50)])
    assert PROFILE.plugin_composite.at(8.0) < durations[True][decode].min()
    np.testing.assert_allclose(same[decode], durations[True][decode], rtol=1e-12)
