"""The observability surface against what the sidecar really exposes: the Grafana dashboard's data
sources and variables hang together, its queries parse (``promtool``), and every metric and label
name the rules and the dashboard use is one a scrape of the sidecar's ``/metrics`` page carries.

What must hold: a name is checked against the *samples* of the page (a counter is read as
``*_total``, a histogram as ``*_bucket``/``*_sum``/``*_count``: the family name alone returns no
data), and each check is shown to fail on a misspelt name (the checker is run on broken copies).
Needs promtool for the parse check (skips without it unless SPECCONTROL_REQUIRE_SYSTEM_DEPS is set;
scripts/ci_system_deps.sh installs it). tests/integration/test_prometheus_scrape.py runs every
dashboard query against a real Prometheus scraping a real sidecar.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.fleet import FleetMetrics
from controller.metrics import SidecarMetrics
from policies.arms import Arm, Method
from policies.observation import StepBatch, StepObservation

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "speccontrol-rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "speccontrol-dashboard.json"
#: Labels Prometheus adds to every scraped series (the PodMonitor's target labels included).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint"}
#: Variables Grafana fills in itself.
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
_NAME = re.compile(r"\bspeccontrol(?:_[A-Za-z0-9_]+|:[A-Za-z0-9_]+:[A-Za-z0-9_]+)")
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_NEW_LABEL = re.compile(r"\bcount_values\b[^(]*\(\s*\"(\w+)\"")


@cache
def exposed() -> dict[str, frozenset[str]]:
    """Sample name -> its label names, read back from the page text of a sidecar with an engine that
    reported, decided and tripped every per-engine and per-reason counter, and a fleet link."""
    reg = CollectorRegistry()
    m = SidecarMetrics(registry=reg, clock=lambda: 1000.0)
    f = FleetMetrics(reg)
    m.set_connected("e1", True)
    step = StepObservation.build(
        time_s=1.0, duration_s=0.05, traffic_class=["a"], method=[Method.EAGLE3], k=[2], drafted=[2],
        accepted=[1], queue_length=1, queue_wait_s=0.1,
    )  # fmt: skip
    m.observe("e1", StepBatch.of(step))
    m.set_directive("e1", version=1, issued_at=999.0, arms={"1/*": Arm(Method.EAGLE3, 2)})
    m.set_guards("e1", {"drift_alarm": 1})
    for c in (m.decisions, m.switches, m.duplicates, m.lost_batches, m.engine_dropped):
        c.labels("e1").inc()
    m.rejected.labels("k_gt_max").inc()
    m.rejected_admin.labels("unauthenticated").inc()
    m.decision_seconds.observe(0.001)
    for c in (f.received, f.published, f.callback_errors):
        c.labels("policy").inc()
    f.malformed.labels("policy", "schema").inc()
    names: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            names.setdefault(s.name, set()).update(s.labels)
    return {n: frozenset(v) for n, v in names.items() if not n.endswith("_created")}


def recorded() -> dict[str, str]:
    rules = yaml.safe_load(RULES.read_text())
    return {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def label_names(selector_body: str) -> set[str]:
    # `{job=~"$job", engine!="a,b"}`: the names before each operator, values dropped first.
    body = re.sub(r'"(?:[^"\\]|\\.)*"', '""', selector_body)
    return {m for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body)}


def problems(expr: str, where: str) -> list[str]:
    """What in ``expr`` names a metric or label a scrape of the sidecar would not have."""
    page, rules = exposed(), recorded()
    found: list[str] = []
    labels = set(TARGET_LABELS) | set(_NEW_LABEL.findall(expr))
    for name in _NAME.findall(expr):
        if name in page:
            labels |= page[name]
        elif name in rules:
            labels |= {x for n in _NAME.findall(rules[name]) for x in page.get(n, ())}
        else:
            found.append(f"{where}: {name} is no sample the sidecar exposes (nor a recording rule)")
    used: set[str] = set()
    for body in _MATCHERS.findall(re.sub(r"\{\{[^}]*\}\}", "", expr)):
        used |= label_names(body)
    for group in _GROUPING.findall(expr):
        used |= {x.strip() for x in group.split(",") if x.strip()}
    found += [f"{where}: label {x!r} is on none of its series" for x in sorted(used - labels)]
    return found


def dashboard_exprs(dash: dict[str, object]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for p in dash["panels"]:  # type: ignore[attr-defined]
        out += [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for t in p["targets"]]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in dash["annotations"]["list"]]  # type: ignore[index]
    out += [
        (f"variable {v['name']!r}", v["definition"])
        for v in dash["templating"]["list"]  # type: ignore[index]
        if v["type"] == "query"
    ]
    return out


def all_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    out = [
        (f"rule {r.get('record') or r.get('alert')}", r["expr"]) for g in rules["groups"] for r in g["rules"]
    ]
    return out + dashboard_exprs(json.loads(DASHBOARD.read_text()))


def test_every_name_in_the_rules_and_the_dashboard_is_on_the_metrics_page() -> None:
    exprs = all_exprs()
    assert len(exprs) > 30
    assert [p for where, e in exprs for p in problems(e, where)] == []


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("speccontrol_drafted_tokens_total", "speccontrol_drafted_tokens"),  # a counter's family name
        ("speccontrol_switches_total", "speccontrol_switchs_total"),
        ("speccontrol:acceptance_rate:rate5m", "speccontrol:acceptance_rate:rate10m"),
        ("sum by (engine, method, k)", "sum by (engine, method, arm)"),
        ('engine=~"$engine"', 'engines=~"$engine"'),
    ],
)
def test_the_name_check_catches_a_misspelt_name(good: str, bad: str) -> None:
    exprs = [(w, e.replace(good, bad)) for w, e in all_exprs() if good in e]
    assert exprs, f"{good!r} is used nowhere: the case tests nothing"
    assert all(problems(e, w) for w, e in exprs)
    assert not problems("histogram_quantile(0.99, rate(speccontrol_decision_seconds_bucket[5m]))", "x")
    assert problems("rate(speccontrol_decision_seconds[5m])", "x")


def test_dashboard_data_sources_and_variables_hang_together() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    want = {"type": "prometheus", "uid": "${datasource}"}
    holders = [("annotation", a) for a in dash["annotations"]["list"]]
    holders += [("variable", v) for v in variables.values() if v["type"] == "query"]
    for p in dash["panels"]:
        holders.append((f"panel {p['title']!r}", p))
        holders += [(f"panel {p['title']!r} {t['refId']}", t) for t in p["targets"]]
    assert [where for where, h in holders if h.get("datasource") != want] == []
    for where, text in dashboard_exprs(dash):
        used = set(re.findall(r"\$\{?(\w+)", text))
        assert used <= set(variables) | GRAFANA_BUILTINS, f"{where}: unknown variables in {text}"


def test_dashboard_units_fit_what_the_panels_show() -> None:
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        shown = [t["expr"] for t in p["targets"] if not t.get("hide")]
        names = {n for e in shown for n in _NAME.findall(e)}
        unit = p["fieldConfig"]["defaults"]["unit"]
        if names and all(n.endswith("_seconds") or n.endswith("_seconds:max") for n in names):
            assert unit == "s", p["title"]
        if any("accepted_tokens" in n for n in names) and any("drafted_tokens" in n for n in names):
            assert unit == "percentunit", p["title"]


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("SPECCONTROL_REQUIRE_SYSTEM_DEPS"):
            pytest.fail("promtool not found but SPECCONTROL_REQUIRE_SYSTEM_DEPS is set")
        pytest.skip("promtool not installed (scripts/ci_system_deps.sh provides it)")
    return path


def check_parses(exprs: list[tuple[str, str]], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on the queries as recording rules, Grafana's variables filled in."""
    fill = {"$__rate_interval": "1m", "$job": ".*", "$engine": ".*"}
    rules = []
    for i, (_, e) in enumerate(exprs):
        if e.startswith("label_values("):
            e = e.removeprefix("label_values(").rsplit(",", 1)[0]
        for var, value in fill.items():
            e = e.replace(var, value)
        rules.append({"record": f"dashboard:query_{i}:check", "expr": e})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return subprocess.run(
        [_promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    out = check_parses(exprs, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout
    broken = check_parses([("x", exprs[0][1].replace(")", "", 1))], tmp_path)
    assert broken.returncode != 0
