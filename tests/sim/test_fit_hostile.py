"""``profile fit`` on step logs that cannot support a profile: it refuses them in one line (exit 2) and
writes nothing, rather than a profile no engine could have (batching for free, or a per-token cost
guessed from a single batch size). What must hold: whatever the durations, a log whose steps all ran
at one batch size, or whose durations fall as the batch grows, never becomes a profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sim.cli import main


def _step(i: int, batch: int, duration_s: float, k: int, prefill: int) -> dict[str, Any]:
    return {
        "engine": "e",
        "time_s": float(i),
        "duration_s": duration_s,
        "batch": batch,
        "prefill_tokens": prefill,
        "kv_tokens": None,
        "decoded_tokens": 37 * i * batch % 5000,
        "method": ["eagle3"] * batch,
        "k": [k] * batch,
        "accepted": [k // 2] * batch,
    }


def _fit(tmp: Path, steps: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, Path]:
    path, out = tmp / "steps.jsonl", tmp / "mine.yaml"
    out.unlink(missing_ok=True)
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    code = main(["profile", "fit", str(path), "--out", str(out)])
    return code, capsys.readouterr().err, out


_SETTINGS = settings(
    max_examples=5,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: each example is a whole fit
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@_SETTINGS
@given(
    batch=st.integers(1, 64),
    base_ms=st.floats(2.0, 50.0),
    jitter=st.lists(st.floats(0.0, 1.0), min_size=80, max_size=80),
    varied_k=st.booleans(),
    prefill=st.booleans(),
)
def test_steps_all_at_one_batch_size_are_refused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    batch: int,
    base_ms: float,
    jitter: list[float],
    varied_k: bool,
    prefill: bool,
) -> None:
    """A fit wrote a profile whose per-token verify cost came from one batch size (with the constant
    fixed at the base profile's, "collinear"): the whole step time charged per token, R² 0."""
    steps = [
        _step(i, batch, (base_ms + j) * 1e-3, 1 + i % 5 if varied_k else 3, (i * 97) % 900 if prefill else 0)
        for i, j in enumerate(jitter)
    ]
    code, err, out = _fit(tmp_path, steps, capsys)
    assert code == 2, err
    assert f"every step at batch {batch}" in err and "varied batch sizes" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


@_SETTINGS
@given(
    const_ms=st.floats(100.0, 400.0),
    fall_ms=st.floats(1.0, 2.5),
    jitter=st.lists(st.floats(0.0, 0.5), min_size=120, max_size=120),
)
def test_durations_that_fall_as_the_batch_grows_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], const_ms: float, fall_ms: float, jitter: list[float]
) -> None:
    """The per-token costs fitted negative were fixed at 0 and the rest went into the constant: a
    profile in which a batch of 32 costs what a batch of 1 does was written, exit 0."""
    steps = []
    for i, j in enumerate(jitter):
        batch = 1 + i % 32
        steps.append(_step(i, batch, (const_ms - fall_ms * batch + j) * 1e-3, 1 + i % 4, 0))
    code, err, out = _fit(tmp_path, steps, capsys)
    assert code == 2, err
    assert "target.batched_s_per_token" in err and "fall as the batch grows" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def _two_engines() -> list[dict[str, Any]]:
    """Steps of two engines, one ten times slower than the other (another GPU, another model)."""
    steps = []
    for i in range(240):
        batch = 1 + i % 16
        fast = i % 2 == 0
        s = _step(i, batch, (6.0 + 0.3 * batch + 0.05 * (i % 7)) * 1e-3 * (1 if fast else 10), 1 + i % 4, 0)
        steps.append({**s, "engine": "pod-a" if fast else "pod-b"})
    return steps


def test_steps_of_several_engines_are_said_and_one_can_be_chosen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Steps of two engines were fitted as one without a word: a profile of neither (R² 0.4 here)."""
    code, err, out = _fit(tmp_path, _two_engines(), capsys)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{tmp_path / 'steps.jsonl'}: steps of 2 engines (pod-a: 120, pod-b: 120)")
    assert "--engine-id" in lines[0]
    path = tmp_path / "steps.jsonl"
    assert main(["profile", "fit", str(path), "--out", str(out), "--engine-id", "pod-b", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["steps"] == 120
    assert main(["profile", "fit", str(path), "--out", str(out), "--engine-id", "pod-c"]) == 2
    assert capsys.readouterr().err == f"--engine-id pod-c: no steps of that engine in {path} (pod-a, pod-b)\n"
