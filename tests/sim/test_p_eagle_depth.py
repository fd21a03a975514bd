"""P-EAGLE at every depth in the simulator: ``static:p_eagle:K`` plays K (it used to play max K whatever K
said), the pass is priced per drafted position where a profile says so (``draft.p_eagle.slot_s``), and
on the shipped dense profiles the best static depth falls as concurrency grows (the P-EAGLE inflection
of vLLM PR #32887: deeper drafts pay at batch 1, cost more than they return at large batches)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pytest

from policies.arms import Arm, Method
from policies.spec import static_policy
from sim.compare import run_one
from sim.costmodel import ProfileError, load_profile, parse_profile
from sim.engines import ENGINES, engine_for_arm
from sim.replay import Replayer
from sim.trace import Trace
from sim.traffic import generate

KS = range(1, 9)


@pytest.fixture(scope="module")
def chat() -> Trace:
    return generate("chat", n_requests=160, seed=3)


def _static(trace: Trace, profile: str, k: int, c: int) -> Any:
    arm = Arm(Method.P_EAGLE, k)
    return run_one(trace, load_profile(profile), static_policy(arm), engine_for_arm(arm), c)


@pytest.mark.parametrize("profile", ["llama-3.1-8b-h100", "gpt-oss-120b-h100"])
def test_every_static_depth_plays_its_own_k(chat: Trace, profile: str) -> None:
    runs = [_static(chat, profile, k, 8) for k in KS]
    drafted_per_step = [r.drafted / r.request_steps for r in runs]
    # Each K drafts K tokens per decoding request-step, so each arm is its own configuration.
    assert drafted_per_step == pytest.approx(list(KS), rel=0.02)
    assert len({round(r.throughput, 6) for r in runs}) == len(KS)
    # Deeper drafts accept more per step (acceptance is monotone in K on the same trace).
    accepted = [r.accepted / r.request_steps for r in runs]
    assert all(b > a for a, b in itertools.pairwise(accepted))


def test_the_stepping_kernel_plays_the_same_depths(chat: Trace) -> None:
    # Adaptive policies and open loop run the per-step kernel, not the vectorised static replay.
    small = chat.subset(np.arange(40))
    prof, eng = load_profile("llama-3.1-8b-h100"), ENGINES["stock-vllm-p-eagle"]
    for k in (2, 6):
        spec = static_policy(Arm(Method.P_EAGLE, k))
        stepped = Replayer(trace=small, profile=prof, engine=eng, policy=spec, concurrency=4).run()
        assert round(stepped.drafted / stepped.request_steps) == k
        assert stepped.throughput == pytest.approx(
            _static(small, "llama-3.1-8b-h100", k, 4).throughput, rel=1e-9
        )


@pytest.mark.parametrize("profile", ["llama-3.1-8b-h100", "llama-3.3-70b-fp8-h200"])
def test_best_depth_falls_with_concurrency(chat: Trace, profile: str) -> None:
    best = {}
    for c in (1, 32):
        tput = [_static(chat, profile, k, c).throughput for k in KS]
        best[c] = int(np.argmax(tput)) + 1
    assert best[1] > best[32], best


def test_p_eagle_engine_advertises_every_depth() -> None:
    eng = ENGINES["stock-vllm-p-eagle"]
    assert [a.k for a in eng.arms(8) if a.method is Method.P_EAGLE] == list(KS)
    assert eng.info(8).playable(()) == eng.arms(8)


def _doc(**p_eagle: Any) -> dict[str, Any]:
    import importlib.resources

    import yaml

    text = importlib.resources.files("sim").joinpath("profiles/llama-3.1-8b-h100.yaml").read_text()
    d: dict[str, Any] = yaml.safe_load(text)
    d["draft"]["p_eagle"] = {"pass_forwards": 1.5, **p_eagle}
    return d


def test_slot_cost_is_per_drafted_position() -> None:
    base = parse_profile(_doc(), source="t")
    assert base.p_eagle_slot_s == 0.0  # absent: the pass is priced as before
    priced = dataclasses.replace(base, p_eagle_slot_s=2e-5)
    kw = dict(kv=8000.0, batched=40.0, eagle_forwards=0.0, eagle_spec=0.0, p_eagle_passes=1.0, ngram_rows=0.0)
    for spec in (8.0, 32.0, 256.0):
        got = priced.step_time(p_eagle_spec=spec, **kw) - base.step_time(p_eagle_spec=spec, **kw)
        assert got == pytest.approx(2e-5 * spec)
    assert parse_profile(_doc(slot_s=3e-6), source="t").p_eagle_slot_s == 3e-6


@pytest.mark.parametrize("bad", ["fast", -1.0, True, None])
def test_bad_slot_cost_names_the_field(bad: Any) -> None:
    with pytest.raises(ProfileError, match=r"draft\.p_eagle\.slot_s"):
        parse_profile(_doc(slot_s=bad), source="t")
