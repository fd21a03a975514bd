"""``sim.steplog``: the recorder writes what the reader reads, counts each request's decoded tokens from
request ids, and a failing disk stops the recording without raising into the sidecar."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from policies.arms import Method
from policies.observation import StepObservation
from sim.steplog import StepRecorder, read_steps


def _obs(ids: list[str], ks: list[int], acc: list[int], finished: list[bool], t: float) -> StepObservation:
    o = StepObservation.build(
        time_s=t,
        duration_s=0.01 + 0.001 * len(ids),
        traffic_class=["default"] * len(ids),
        method=[Method.EAGLE3 if k else Method.OFF for k in ks],
        k=ks,
        drafted=ks,
        accepted=acc,
        request_id=ids,
        prefill_tokens=100 if t == 0 else 0,
    )
    return dataclasses.replace(o, finished=np.array(finished))


def test_recorder_round_trips_and_counts_decoded_tokens(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    rec = StepRecorder(path=path)
    steps = [
        _obs(["a", "b"], [3, 0], [2, 0], [False, False], 0.0),  # a: 3 tokens, b: 1
        _obs(["a", "b"], [3, 2], [3, 1], [False, True], 1.0),  # before: 3 + 1; b finishes
        _obs(["a", "b"], [1, 1], [0, 0], [False, False], 2.0),  # a new "b": 0 before it
    ]
    rec("pod-1", steps[:2])
    rec("pod-1", steps[2:])
    rec.close()
    rec("pod-1", steps)  # after close: nothing
    log = read_steps(path)
    assert log.n == 3 and rec.steps == 3
    assert log.decoded_tokens.tolist() == [0, 4, 7]
    assert log.kv_tokens is None and log.engine == ("pod-1",) * 3
    assert log.prefill_tokens.tolist() == [100, 0, 0]
    assert log.k.tolist() == [3, 0, 3, 2, 1, 1] and log.row_step.tolist() == [0, 0, 1, 1, 2, 2]
    np.testing.assert_allclose(log.duration_s, [0.012] * 3)
    assert log.emitted_tokens() == 6 + 6


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to fail a write")
def test_a_failed_write_stops_recording_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    rec = StepRecorder(path=Path("/dev/full"))
    with caplog.at_level(logging.ERROR):
        rec("pod-1", [_obs(["a"] * 1, [2], [1], [False], 0.0)] * 300)
        rec("pod-1", [_obs(["a"], [2], [1], [False], 1.0)])
    assert rec.steps == 0
    assert "recording stopped after 0 steps" in caplog.text and caplog.text.count("/dev/full") == 1


def test_select_keeps_the_chosen_steps_and_their_rows(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    rec = StepRecorder(path=path)
    rec(
        "e",
        [
            _obs(
                ["a", "b", "c"][: i % 3 + 1],
                [i % 4] * (i % 3 + 1),
                [0] * (i % 3 + 1),
                [False] * (i % 3 + 1),
                float(i),
            )
            for i in range(300)
        ],
    )
    rec.close()
    log = read_steps(path)
    keep = (np.arange(log.n) % 7) < 3
    sub = log.select(keep)
    assert sub.n == int(keep.sum()) and sub.time_s.tolist() == log.time_s[keep].tolist()
    assert np.bincount(sub.row_step).tolist() == np.bincount(log.row_step)[keep].tolist()
    assert sub.k.tolist() == log.k[keep[log.row_step]].tolist()


def _one_step(path: Path, duration_s: float, batch: int) -> Path:
    import json

    row = {"engine": "e", "time_s": 1.0, "duration_s": duration_s, "batch": batch, "prefill_tokens": 0,
           "decoded_tokens": 3, "method": ["eagle3"], "k": [2], "accepted": [2]}  # fmt: skip
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("batch", [1, 20, 21, 64, 4096, 1 << 20])  # (1 << 20: MAX_BATCH, 52 ms)
def test_a_step_faster_than_any_engine_is_refused_by_line(tmp_path: Path, batch: int) -> None:
    """A hand-made log taught ``sim fit`` from steps no engine runs (64 requests in 1 us: 1.9e8 tok/s)
    that the sidecar refuses in telemetry; the floor is the one the sidecar holds steps to."""
    from policies.physics import step_floor_s
    from sim.steplog import StepLogError

    floor = step_floor_s(batch)
    assert read_steps(_one_step(tmp_path / "ok.jsonl", floor, batch)).duration_s.tolist() == [floor]
    below = float(np.nextafter(floor, 0.0))
    with pytest.raises(StepLogError, match=r"bad\.jsonl:1: duration_s: "):
        read_steps(_one_step(tmp_path / "bad.jsonl", below, batch))
