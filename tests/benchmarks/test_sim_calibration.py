"""benchmarks/sim_calibration.py: its tables are the simulator's own replays, written as the doc reads them."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_results as rr  # noqa: E402
import sim_calibration as sc  # noqa: E402


def test_a_small_run_writes_what_the_doc_blocks_read(tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    assert sc.main(["--requests", "20", "--seed", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["command"] == "python benchmarks/sim_calibration.py --requests 20 --seed 3"
    assert [r["class"] for r in doc["acceptance"]] == list(sc.CLASSES)
    for r in doc["acceptance"]:
        acc = r["accepted_per_step"]
        assert list(acc) == list(sc.ARMS)
        assert 0 < acc["eagle3:3"] <= acc["eagle3:7"] <= 7  # a longer draft never accepts less
        assert acc["ngram:4"] <= acc["ngram:8"]
    assert len(doc["p_eagle_depth"]) == len(sc.DEPTH_PROFILES) * len(sc.LEVELS)
    for r in doc["p_eagle_depth"]:
        sp = r["speedup_vs_no_spec"]
        assert sp[str(r["best_k"])] == max(sp.values())
        assert all(v > 1 for v in sp.values())  # P-EAGLE beats no speculation at every depth here
    assert "| code-edit |" in rr.sim_acceptance_table(doc)
    assert "| gpt-oss-120b-h100 | 32 |" in rr.p_eagle_depth_table(doc)


def test_bad_requests_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        sc.main(["--requests", "0"])
    assert e.value.code == 2
    assert "argument --requests: must be an integer 1..100000, got '0'" in capsys.readouterr().err
