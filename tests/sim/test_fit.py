"""``sim.fit`` and ``profile fit``: known coefficients recovered from synthetic steps (with noise, within
the stated intervals), unidentifiable parameters fixed and said so, bad files refused, and a run recorded
by a real sidecar (``serve --record-steps``) from an engine over gRPC round-trips through the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.cli import main
from sim.costmodel import load_profile
from sim.engines import ENGINES
from sim.fit import PARAMS, FitError, features, fit_steps, profile_of, t_quantile
from sim.steplog import StepLog, read_steps, write_steps

BASE = load_profile("llama-3.1-8b-h100")
ENGINE = ENGINES["stock-vllm-ngram"]  # runs no drafter unverified: the features count drafts only
TRUE = np.array([5e-8, 3e-5, 7e-3, 3e-9, 1.2e-6, 0.8e-3, 1.7, 0.01])


def synthetic(
    n: int, seed: int, *, kinds: tuple[str, ...] = ("eagle3", "ngram", "mix", "p_eagle", "off")
) -> list[dict[str, Any]]:
    """Steps of varied batch, K, method mix, prefill and context (durations filled in later)."""
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        b = int(rng.integers(1, 33))
        kind = str(rng.choice(kinds))
        top = int(rng.integers(1, 7))
        meth = (
            [str(m) for m in rng.choice(["eagle3", "ngram", "off"], size=b)] if kind == "mix" else [kind] * b
        )
        ks = [0 if m == "off" else (int(rng.integers(1, top + 1)) if kind == "mix" else top) for m in meth]
        recs.append(
            {
                "engine": "e",
                "time_s": float(i),
                "duration_s": 1.0,
                "batch": b,
                "prefill_tokens": int(rng.integers(0, 2000)) if rng.random() < 0.2 else 0,
                "kv_tokens": None,
                "decoded_tokens": int(rng.integers(0, 600 * b)),
                "method": meth,
                "k": ks,
                "accepted": [int(rng.integers(0, k + 1)) for k in ks],
            }
        )
    return recs


def with_durations(
    tmp: Path, recs: list[dict[str, Any]], theta: np.ndarray, *, noise_s: float, seed: int, cost: str
) -> StepLog:
    path = tmp / "steps.jsonl"
    write_steps(path, recs)
    y = profile_of(BASE, theta, cost).step_time(**features(read_steps(path), ENGINE))  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    for r, d in zip(recs, y, strict=True):
        r["duration_s"] = float(d + rng.normal(0.0, noise_s))
    write_steps(path, recs)
    return read_steps(path)


@pytest.mark.parametrize("cost", ["per_forward", "per_draft"])
def test_fit_recovers_known_coefficients_within_the_intervals(tmp_path: Path, cost: str) -> None:
    steps = with_durations(tmp_path, synthetic(800, 1), TRUE, noise_s=2e-4, seed=2, cost=cost)
    fit = fit_steps(steps, base=BASE, engine=ENGINE, draft_cost=cost, level=0.99)  # type: ignore[arg-type]
    for p, true in zip(fit.params, TRUE, strict=True):
        assert p.status == "fitted", p
        assert p.ci_low <= true <= p.ci_high, (p, true)
        assert p.ci_low < p.value < p.ci_high
    assert fit.rmse_s == pytest.approx(2e-4, rel=0.1)  # the noise, nothing more
    # The other draft-cost model fits these steps worse.
    other = "per_draft" if cost == "per_forward" else "per_forward"
    assert fit_steps(steps, base=BASE, engine=ENGINE, draft_cost=other).rmse_s > 1.2 * fit.rmse_s  # type: ignore[arg-type]


def test_intervals_cover_at_about_their_level(tmp_path: Path) -> None:
    """Over 40 noisy data sets, 95 % intervals hold the true batched-token coefficient 32-40 times."""
    recs = synthetic(300, 7)
    hits = 0
    for s in range(40):
        steps = with_durations(tmp_path, recs, TRUE, noise_s=5e-4, seed=100 + s, cost="per_forward")
        p = fit_steps(steps, base=BASE, engine=ENGINE).param("target.batched_s_per_token")
        hits += p.ci_low <= TRUE[1] <= p.ci_high
    assert 32 <= hits <= 40


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    scale=st.lists(st.floats(0.2, 5.0), min_size=8, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_noise_free_steps_give_the_coefficients_back(tmp_path: Path, scale: list[float], seed: int) -> None:
    theta = TRUE * np.array(scale)
    steps = with_durations(tmp_path, synthetic(200, seed), theta, noise_s=0.0, seed=0, cost="per_forward")
    fit = fit_steps(steps, base=BASE, engine=ENGINE)
    np.testing.assert_allclose([p.value for p in fit.params], theta, rtol=1e-5)


def test_parameters_the_steps_cannot_inform_are_fixed_and_said_so(tmp_path: Path) -> None:
    steps = with_durations(
        tmp_path, synthetic(400, 3, kinds=("eagle3", "off")), TRUE, noise_s=1e-4, seed=4, cost="per_forward"
    )
    fit = fit_steps(steps, base=BASE, engine=ENGINE)
    pe, ng = fit.param("draft.p_eagle.pass_forwards"), fit.param("draft.ngram.verify_fraction")
    assert pe.status == ng.status == "fixed"
    assert "no P-EAGLE drafting" in pe.note and "no n-gram drafting" in ng.note
    assert pe.value == BASE.p_eagle_pass_forwards and ng.value == BASE.ngram_verify_fraction
    assert fit.param("target.batched_s_per_token").status == "fitted"


def test_a_coefficient_that_fits_negative_is_fixed_at_zero(tmp_path: Path) -> None:
    theta = TRUE.copy()
    theta[0] = -2e-8  # more context made steps faster: not a cost model the simulator accepts
    steps = with_durations(tmp_path, synthetic(400, 5), theta, noise_s=1e-4, seed=6, cost="per_forward")
    p = fit_steps(steps, base=BASE, engine=ENGINE).param("target.kv_s_per_token")
    assert (p.status, p.value) == ("fixed", 0.0) and "negative" in p.note


def test_too_few_steps_is_a_clear_error(tmp_path: Path) -> None:
    steps = with_durations(tmp_path, synthetic(9, 1), TRUE, noise_s=1e-4, seed=2, cost="per_forward")
    with pytest.raises(FitError, match=r"9 steps for \d+ parameters: record more steps"):
        fit_steps(steps, base=BASE, engine=ENGINE)


def test_t_quantile_matches_the_tables() -> None:
    assert t_quantile(0.975, 10) == pytest.approx(2.228, abs=2e-3)
    assert t_quantile(0.975, 30) == pytest.approx(2.042, abs=1e-3)
    assert t_quantile(0.995, 20) == pytest.approx(2.845, abs=5e-3)


def test_profile_fit_cli_writes_a_loadable_profile_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = with_durations(tmp_path, synthetic(500, 8), TRUE, noise_s=2e-4, seed=9, cost="per_forward")
    out, png = tmp_path / "mine.yaml", tmp_path / "resid.png"
    args = [steps.source, "--out", str(out), "--plot", str(png), "--engine", "stock-vllm-ngram"]
    assert main(["profile", "fit", *args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["draft_cost"] == "per_forward" and res["steps"] == 500
    assert set(res["residual_rms_s_by_draft_cost"]) == {"per_forward", "per_draft"}
    assert set(res["parameters"]) == set(PARAMS)
    prof = load_profile(str(out))
    assert prof.name == "mine" and prof.eagle3_cost == "per_forward" and prof.fit_k == 1
    assert prof.target.batched_s_per_token == pytest.approx(TRUE[1], rel=0.01)
    assert yaml.safe_load(out.read_text())["fit"]["steps"] == 500
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _step(**fields: Any) -> str:
    """A valid step line with ``fields`` replaced."""
    d = {"duration_s": 0.01, "batch": 1, "prefill_tokens": 0, "method": ["eagle3"], "k": [2], "accepted": [1]}
    return json.dumps({**d, **fields})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{", "invalid JSON"),
        (
            '{"duration_s": 0, "batch": 1, "prefill_tokens": 0, "method": [], "k": [], "accepted": []}',
            "duration_s",
        ),
        (
            '{"duration_s": 0.01, "batch": 2, "prefill_tokens": 0, "method": ["eagle3", "x"], "k": [1, 1], '
            '"accepted": [0, 0]}',
            "method[1]: unknown method 'x'",
        ),
        (
            '{"duration_s": 0.01, "batch": 2, "prefill_tokens": 0, "method": ["eagle3", "off"], "k": [1, -1], '
            '"accepted": [0, 0]}',
            "k[1]: expected an integer 0..64",
        ),
        (
            '{"duration_s": 0.01, "batch": 1, "prefill_tokens": 0, "method": ["eagle3"], "k": [2], '
            '"accepted": [3]}',
            "accepted[0]: 3 accepted of a draft of k = 2",
        ),
        (
            '{"duration_s": 0.01, "batch": 1, "prefill_tokens": 0, "method": ["eagle3", "off"], "k": [2, 0], '
            '"accepted": [0, 0]}',
            "batch: 1 running but 2 requests reported",
        ),
        (
            '{"duration_s": 0.01, "batch": 1, "prefill_tokens": 0, "method": ["eagle3"], "k": [2, 1], '
            '"accepted": [0]}',
            "k: expected 1 entries",
        ),
        ("[1, 2]", "expected a JSON object"),
        # Tracebacks (ValueError, RecursionError): read_steps called json.loads itself.
        ('{"x": ' + "9" * 5000 + "}", "invalid JSON: a number longer than 4300 digits"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested deeper than 32 levels"),
        # Beyond int64 or a double: OverflowError tracebacks when the columns were built.
        (_step(batch=2**63), "batch: expected an integer 0..1048576, got 9223372036854775808"),
        (_step(prefill_tokens=10**30), "prefill_tokens: expected an integer 0..4194304"),
        (_step(decoded_tokens=10**400), "decoded_tokens: expected an integer 0..4398046511104"),
        (_step(time_s=10**400), "time_s: expected a number 0..1e+11"),
        # Not physics: a fit over them wrote a profile with infinite intervals, or a different fit.
        (_step(duration_s=1e308), "duration_s: expected a number 1e-06..3600, got 1e+308"),
        (_step(duration_s=1e-9), "duration_s: expected a number 1e-06..3600"),
        (_step(method=["off"], k=[64], accepted=[64]), "k[0]: a draft of k = 64 with method off"),
        (_step(method=["off"], k=[0], accepted=[1]), "accepted[0]: 1 accepted of a draft of k = 0"),
    ],
)
def test_a_bad_line_is_named_file_line_field_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    good = synthetic(50, 1)
    path = tmp_path / "bad.jsonl"
    write_steps(path, good)
    with path.open("a") as f:
        f.write(line + "\n")
    out = tmp_path / "p.yaml"
    assert main(["profile", "fit", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:51: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.jsonl"
    write_steps(path, synthetic(50, 1))
    with pytest.raises(SystemExit) as e:
        main(["profile", "fit", str(path), "--out", str(tmp_path / "p.yaml"), "--level", "1.5"])
    assert e.value.code == 2
    assert "argument --level: must be a number in [0.5, 1), got '1.5'" in capsys.readouterr().err
    assert main(["profile", "fit", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "p.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_collinear_parameters_are_fixed_and_named(tmp_path: Path) -> None:
    """Every step drafts EAGLE-3 at K = 2: the per-forward constant moves with the target's constant
    and draft tokens with batched tokens, so the steps cannot separate them."""
    recs = synthetic(300, 11, kinds=("eagle3",))
    for r in recs:
        r["k"] = [2] * len(r["k"])
        r["accepted"] = [min(a, 2) for a in r["accepted"]]
        r["prefill_tokens"] = 0
    steps = with_durations(tmp_path, recs, TRUE, noise_s=1e-4, seed=12, cost="per_forward")
    fit = fit_steps(steps, base=BASE, engine=ENGINE)
    fixed = {p.name: p.note for p in fit.params if p.status == "fixed"}
    assert any("collinear with" in n for n in fixed.values()), fixed
    assert fit.rmse_s == pytest.approx(1e-4, rel=0.15)  # what is fixed is absorbed by the rest


def _idle_engine_steps(tmp: Path) -> Path:
    """Every step at batch 1 with drafting off (an idle engine), written as a step log."""
    rng = np.random.default_rng(13)
    recs = synthetic(300, 13, kinds=("off",))
    for r in recs:
        r["batch"], r["method"], r["k"], r["accepted"] = 1, ["off"], [0], [0]
        r["prefill_tokens"], r["decoded_tokens"] = 0, int(rng.integers(0, 600))
        r["duration_s"] = 7e-3 + 5e-8 * r["decoded_tokens"] + float(rng.normal(0.0, 2e-4))
    path = tmp / "steps.jsonl"
    write_steps(path, recs)
    return path


def test_steps_that_inform_no_parameter_are_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every step at batch 1 with drafting off (an idle engine): the batched tokens are constant and
    collinear with the constants, so each parameter is fixed in turn; the fit says what to record
    rather than failing inside numpy."""
    path = _idle_engine_steps(tmp_path)
    with pytest.raises(FitError, match=r"inform none of the parameters \(every step at batch 1; no request"):
        fit_steps(read_steps(path), base=BASE, engine=ENGINES["stock-vllm"])
    out = tmp_path / "p.yaml"
    assert main(["profile", "fit", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}: the steps inform none") and "varied batch sizes" in err
    assert err.count("\n") == 1 and not out.exists()


@pytest.mark.parametrize("seed", range(6))
def test_which_collinear_parameter_is_fixed_does_not_depend_on_the_basis_lapack_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    # The steps above, where three singular values are near 0: the fit fixed the column largest in
    # the last singular vector, one arbitrary combination of the three, so the parameters fixed (and
    # whether the fit ended in a profile or this error) changed with the machine's BLAS (a clean-clone
    # CI passed the test above; the same code failed it on the next machine). Here every near-null
    # basis is turned by a random rotation, as another LAPACK may return it: the same outcome.
    path = _idle_engine_steps(tmp_path)
    svd, turn = np.linalg.svd, np.random.default_rng(seed)
    turned = []

    def other_lapack(a: np.ndarray, full_matrices: bool = True) -> Any:
        u, sv, vt = svd(a, full_matrices=full_matrices)
        near = np.flatnonzero(sv < 1e-9 * sv[0])
        if len(near) > 1:
            q, _ = np.linalg.qr(turn.normal(size=(len(near), len(near))))
            vt = vt.copy()
            vt[near] = q @ vt[near]
            turned.append(len(near))
        return u, sv, vt

    monkeypatch.setattr(np.linalg, "svd", other_lapack)
    with pytest.raises(FitError) as caught:
        fit_steps(read_steps(path), base=BASE, engine=ENGINES["stock-vllm"])
    assert turned and "inform none of the parameters (every step at batch 1" in str(caught.value)


def test_texts_written_like_numbers_survive_the_profile_file(tmp_path: Path) -> None:
    # The YAML 1.2 float rule read `model: 2e5` as 200000.0: the profile `profile fit` wrote (unquoted,
    # YAML 1.1's dump) was refused by load_profile ("model: expected a string, got 200000.0").
    steps = with_durations(tmp_path, synthetic(300, 8), TRUE, noise_s=2e-4, seed=3, cost="per_forward")
    out = tmp_path / "p.yaml"
    args = [
        steps.source,
        "--out",
        str(out),
        "--engine",
        "stock-vllm-ngram",
        "--name",
        "1e3",
        "--model",
        "2e5",
    ]
    assert main(["profile", "fit", *args, "--hardware", "1E2"]) == 0
    prof = load_profile(str(out))
    assert (prof.name, prof.model, prof.hardware) == ("1e3", "2e5", "1E2")
    # and a hand-written one, unquoted: its text fields as written
    text = out.read_text().replace("'2e5'", "2e5")
    hand = tmp_path / "hand.yaml"
    hand.write_text(text)
    assert load_profile(str(hand)).model == "2e5"
