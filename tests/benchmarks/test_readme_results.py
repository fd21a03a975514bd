"""README.md's result blocks are exactly what benchmarks/readme_results.py derives from the results files."""

import copy
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_results as rr  # noqa: E402


def test_readme_blocks_are_up_to_date() -> None:
    assert rr.main(["--check"]) == 0, "README.md results are stale: run python benchmarks/readme_results.py"


def test_a_changed_result_changes_the_readme() -> None:
    readme = rr.README.read_text()
    md = rr.DECISION_QUALITY.read_text()
    doc = json.loads(rr.AUTOSCALE.read_text())
    row = next(line for line in md.splitlines() if line.startswith("| drift | 8 | default @ composite |"))
    cells = row.split("|")
    cells[5] = " 9.999 "  # × best static
    changed = rr.updated_readme(readme, md.replace(row, "|".join(cells)), doc)
    assert "| drift (goal ≥ 1.30) | " in changed and "| 9.999 |" in changed
    cold = copy.deepcopy(doc)
    cold["replica"]["time_to_95pct_s"]["cold"] = 42.0
    assert "; a cold one in 42 s (mean efficiency" in rr.updated_readme(readme, md, cold)


def test_missing_rows_and_markers_are_named() -> None:
    md = rr.DECISION_QUALITY.read_text()
    doc = json.loads(rr.AUTOSCALE.read_text())
    without = "\n".join(
        line for line in md.splitlines() if not line.startswith("| maths | 32 | default @ composite")
    )
    with pytest.raises(rr.ResultsError, match=re.escape("maths | 32 | default @ composite")):
        rr.decision_quality_table(without)
    with pytest.raises(rr.ResultsError, match="results:decision-quality"):
        rr.updated_readme("no markers here", md, doc)
    with pytest.raises(rr.ResultsError, match="replica"):
        rr.autoscale_sentence({})


def _results(name: str) -> dict:
    return json.loads((rr.RESULTS / name).read_text())


def test_every_generated_figure_comes_from_its_results_file() -> None:
    demo = [_results(f"demo-seed{s}.json") for s in rr.DEMO_SEEDS]
    changed = copy.deepcopy(demo)
    changed[1]["adaptive_vs_best_static"] = 1.5
    assert "x the best static arm**" in rr.demo_text(demo)
    assert "-1.500x the best static arm**" in rr.demo_text(changed)
    assert "is **not met**" in rr.demo_text(demo) or min(d["adaptive_vs_best_static"] for d in demo) >= 1.15

    load = _results("sidecar-load.json")
    assert f"{load['request_steps_unapplied']:,} request-steps left unapplied" in rr.sidecar_load_text(load)
    load["request_steps_unapplied"] = 123456
    assert "123,456 request-steps left unapplied" in rr.sidecar_load_text(load)

    speed = _results("sim-speed.json")
    speed["runs"][0]["request_steps_per_s"] = 9_870_000
    assert "9.87 M request-steps/s" in rr.sim_speed_text(speed)
    assert "| 9,870,000 |" in rr.sim_speed_table(speed)

    engine, scripted = _results("plugin-overhead.json"), _results("plugin-overhead-scripted.json")
    engine["us_per_step"] = {"8": 11.0, "32": 22.0}
    # A file of one run (older files) says nothing of runs.
    assert "11 / 22 µs per decode step at batch 8 / 32" in rr.plugin_cost_text(
        {**engine, "repeat": 1}, scripted
    )
    engine = {**engine, "repeat": 3, "us_per_step_range": {"32": [20.0, 30.4], "8": [10.2, 12.0]}}
    text = rr.plugin_cost_text(engine, scripted)
    assert "11 / 22 µs (runs 10-12 / 20-30) per decode step at batch 8 / 32" in text
    assert "(median, the median of 3 runs; K-table-only in the same runs:" in text
    scripted = {**scripted, "cold_mb": 4}
    scripted["by_mode"] = {
        **scripted["by_mode"],
        "composite-async": {"cold_us_per_step": {"32": 301.0, "8": 250.4}},
    }
    assert "with 4 MB written before every hook call" in rr.plugin_cost_text(engine, scripted)
    assert "evicted, as the engine's own work between hooks does): 250 / 301 µs" in rr.plugin_cost_text(
        engine, scripted
    )
    del scripted["by_mode"]["composite-async"]["cold_us_per_step"]
    with pytest.raises(rr.ResultsError, match=r"by_mode\.composite-async\.cold_us_per_step"):
        rr.plugin_cost_text(engine, scripted)


def test_missing_files_keys_and_unknown_blocks_are_named(tmp_path: Path) -> None:
    with pytest.raises(rr.ResultsError, match="missing"):
        rr._json(rr.RESULTS / "no-such-result.json")
    with pytest.raises(rr.ResultsError, match=re.escape("decision_ms.p99")):
        doc = _results("sidecar-load.json")
        del doc["decision_ms"]["p99"]
        rr.sidecar_load_text(doc)
    with pytest.raises(rr.ResultsError, match="unknown results block 'nope'"):
        rr.updated("<!-- results:nope -->\n<!-- /results:nope -->", "docs/x.md", {})
    with pytest.raises(rr.ResultsError, match=re.escape("README.md: no <!-- results:demo -->")):
        rr.updated("no blocks", "README.md", {}, ("demo",))
    with pytest.raises(rr.ResultsError, match="no run of oracle per step @ oracle"):
        rr.example_report_text({"runs": []})


def test_blocks_in_docs_are_rewritten_wherever_they_are() -> None:
    body = rr.GENERATORS["plugin-cost"]()
    text = "a\n<!-- results:plugin-cost -->\nstale 442 µs\n<!-- /results:plugin-cost -->\nb"
    assert rr.updated(text, "docs/production.md", {}) == (
        f"a\n<!-- results:plugin-cost -->\n{body}\n<!-- /results:plugin-cost -->\nb"
    )
    for doc in ("production.md", "vllm-plugin.md", "reliability.md", "simulator.md"):
        assert "<!-- results:" in (rr.ROOT / "docs" / doc).read_text(), doc


def test_the_drift_mixed_table_and_its_goals_follow_the_file() -> None:
    md = rr.DECISION_QUALITY_NOW.read_text()
    row = next(line for line in md.splitlines() if line.startswith("| mixed | 8 | default @ composite |"))
    cells = row.split("|")
    cells[5] = " 1.400 "  # × best static: now above the 1.30 goal
    changed = rr.decision_quality_now(md.replace(row, "|".join(cells)))
    assert "| mixed (goal ≥ 1.30) | " in changed and "| 1.400 |" in changed
    met = changed.split("Met: ")[1].split("Not met:")[0]
    assert "mixed c=8" in met.split("≥ 0.88")[0]  # listed under the 1.30 goal
    cells[5] = " 0.500 "
    missed = rr.decision_quality_now(md.replace(row, "|".join(cells))).split("Not met: ")[1]
    assert "mixed c=8" in missed.split("≥ 0.88")[0]
    with pytest.raises(rr.ResultsError, match=re.escape("no row 'mixed | 8 | default @ composite'")):
        rr.decision_quality_now(md.replace(row, ""))


def test_the_sim_vs_engine_table_follows_its_file() -> None:
    doc = _results("sim-vs-engine.json")
    text = rr.sim_vs_engine_text(doc)
    assert text.count("\n| ") == len(doc["rows"]) + 1  # the separator row, then one per setting
    doc["rows"][0]["sim_over_engine"] = 7.25
    assert "| 7.250 |" in rr.sim_vs_engine_text(doc)
    del doc["fit"]
    with pytest.raises(rr.ResultsError, match="missing fit"):
        rr.sim_vs_engine_text(doc)


def test_the_demo_headroom_follows_its_files() -> None:
    headroom = _results("demo-headroom.json")
    runs = [_results(f"demo-seed{s}.json") for s in rr.DEMO_SEEDS]
    text = rr.demo_headroom_text(headroom, runs)
    assert "so 1.15x is beyond the best causal rule" in text
    for ph in headroom["phases"]:  # the hindsight rule 20 % above every phase's best static arm
        ph["hindsight_rule_vs_best_static"] = 1.2
    changed = rr.demo_headroom_text(headroom, runs)
    assert "/ 1.200 / 1.200 /" in changed and "so 1.15x is within reach of the best causal rule" in changed
    del headroom["phases"][2]["per_step_oracle_vs_best_static"]
    with pytest.raises(rr.ResultsError, match=re.escape("phases[2]: missing per_step_oracle_vs_best_static")):
        rr.demo_headroom_text(headroom, runs)
    headroom = _results("demo-headroom.json")
    headroom["phases"].pop()
    with pytest.raises(rr.ResultsError, match=re.escape("4 phases, docs/results/demo-headroom.json has 3")):
        rr.demo_headroom_text(headroom, runs)


def test_the_sim_vs_engine_verdict_follows_the_held_out_error() -> None:
    doc = _results("sim-vs-engine.json")
    held = doc["error"]["held out"]
    held["within_10pct"] = 0
    assert "is **not met**" in rr.sim_vs_engine_text(doc)
    held["within_10pct"] = held["of"]
    assert "is **met**" in rr.sim_vs_engine_text(doc)


def test_the_decision_quality_block_names_the_command_of_its_doc() -> None:
    md = rr.DECISION_QUALITY.read_text()
    assert "generated by `python benchmarks/decision_quality.py" in rr.decision_quality_table(md)
    with pytest.raises(rr.ResultsError, match="no 'Generated by `COMMAND`' header"):
        rr.decision_quality_table(md.replace("Generated by", "Made by"))


def test_the_generated_decision_quality_header_links_the_history_it_cannot_rerun() -> None:
    import argparse

    import decision_quality as dq

    for out in ("docs/decision-quality.md", "docs/results/decision-quality-drift-mixed.md"):
        a = argparse.Namespace(
            requests=120,
            seed=0,
            jobs=1,
            ngram_signal="on",
            policies=",".join(dq.POLICIES),
            scenarios=",".join((*dq.CLOSED, "load-ramp")),
            no_hindsight=False,
            out=str(rr.ROOT / out),
        )
        head = "\n".join(dq.render([], [], [], {}, 8, a))
        link = re.search(r"\[decision-quality-history\.md\]\(([^)]+)\)", head)
        assert link is not None
        assert ((rr.ROOT / out).parent / link.group(1)).resolve() == dq.HISTORY
    assert dq.HISTORY.is_file()
    assert rr.DECISION_QUALITY.read_text().count("(decision-quality-history.md)") == 1


def test_the_calibration_tables_follow_their_file() -> None:
    doc = _results("sim-calibration.json")
    assert rr.sim_acceptance_table(doc).count("\n| ") == len(doc["acceptance"]) + 1
    doc["acceptance"][0]["accepted_per_step"]["eagle3:3"] = 9.876
    assert "| chat | 9.88 |" in rr.sim_acceptance_table(doc)
    doc["p_eagle_depth"][0]["speedup_vs_no_spec"]["8"] = 7.5
    assert "| 7.50 |" in rr.p_eagle_depth_table(doc)
    del doc["p_eagle_depth"][1]["speedup_vs_no_spec"]["3"]
    with pytest.raises(rr.ResultsError, match=re.escape("p_eagle_depth[1]: K")):
        rr.p_eagle_depth_table(doc)
    del doc["acceptance"][2]["accepted_per_step"]
    with pytest.raises(rr.ResultsError, match=re.escape("acceptance[2]: missing accepted_per_step")):
        rr.sim_acceptance_table(doc)
