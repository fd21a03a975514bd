"""A real Prometheus scrapes a running sidecar every second and evaluates deploy/'s rules on its data.

What must hold: every query of the Grafana dashboard (panels, annotations, template variables) returns
series from a real sidecar with an engine reporting over real gRPC, and every ``{{label}}`` its legend
or annotation text names is a label of those series (Grafana prints the label's name instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from controller.config import SidecarConfig
from controller.fleet import FleetMetrics
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from policies.arms import Method
from policies.observation import StepBatch, StepObservation
from tests.integration.test_sidecar_grpc import TestEngine, hello, step

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "speccontrol-rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "speccontrol-dashboard.json"
JOB = "speccontrol-sidecar"


def _prometheus() -> str:
    path = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )
    if path is None:
        if os.environ.get("SPECCONTROL_REQUIRE_SYSTEM_DEPS"):
            pytest.fail("prometheus not found but SPECCONTROL_REQUIRE_SYSTEM_DEPS is set")
        pytest.skip("prometheus not installed (scripts/ci_system_deps.sh installs it)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def prometheus(target: str, tmp: Path) -> Iterator[str]:
    binary = _prometheus()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                # The PodMonitor's job is "<namespace>/speccontrol-sidecar"; the rules accept both.
                "job_name": JOB,
                "scrape_interval": "1s",
                "static_configs": [{"targets": [target]}],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    for _ in range(3):  # the free port can be taken between probe and bind
        port = _free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=out,
                stderr=out,
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                if r.status == 200:
                    break
            time.sleep(0.1)
        if proc.poll() is None:
            break
    else:
        raise RuntimeError(f"prometheus did not start: {log.read_text()[-3000:]}")
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def query(url: str, expr: str) -> list[dict[str, object]]:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    result: list[dict[str, object]] = body["data"]["result"]
    return result


async def test_prometheus_scrapes_the_sidecar_and_evaluates_rules(tmp_path: Path) -> None:
    _prometheus()
    config = SidecarConfig(
        engine_listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        state_dir=str(tmp_path / "state"),
    )
    sidecar = Sidecar(config=config)
    await sidecar.start()
    stop = asyncio.Event()

    async def feed() -> None:
        # What the engine service records for each reported step: 4 drafted, 3 accepted per request.
        while not stop.is_set():
            sidecar.metrics.observe(
                "engine-0",
                StepBatch.of(
                    StepObservation.build(
                        time_s=time.time(),
                        duration_s=0.02,
                        traffic_class=["default", "default"],
                        method=[Method.EAGLE3, Method.EAGLE3],
                        k=[4, 4],
                        drafted=[4, 4],
                        accepted=[3, 3],
                        queue_length=2,
                        queue_wait_s=0.25,
                    )
                ),
            )
            await asyncio.sleep(0.1)

    sidecar.metrics.set_connected("engine-0", True)  # as its attach does: gauges describe attached engines
    feeder = asyncio.create_task(feed())
    try:
        target = sidecar.metrics_url.removeprefix("http://").removesuffix("/metrics")
        with prometheus(target, tmp_path) as url:
            acceptance: list[dict[str, object]] = []
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                acceptance = await asyncio.to_thread(query, url, "speccontrol:acceptance_rate:rate5m")
                if acceptance:
                    break
                await asyncio.sleep(0.5)
            assert acceptance, "the recording rule never produced a value"
            (sample,) = acceptance
            labels = sample["metric"]
            assert isinstance(labels, dict)
            assert labels == {
                "__name__": "speccontrol:acceptance_rate:rate5m",
                "engine": "engine-0",
                "method": "eagle3",
                "instance": target,
                "job": "speccontrol-sidecar",
            }
            value = sample["value"]
            assert isinstance(value, list)
            assert float(value[1]) == pytest.approx(0.75, abs=1e-9)

            (wait,) = await asyncio.to_thread(query, url, "speccontrol:queue_wait_seconds:max")
            assert isinstance(wait["value"], list) and float(wait["value"][1]) == 0.25
            up = await asyncio.to_thread(query, url, 'up{job="speccontrol-sidecar"}')
            assert [float(s["value"][1]) for s in up] == [1.0]  # type: ignore[index]
            rules = await asyncio.to_thread(
                lambda: json.load(urllib.request.urlopen(f"{url}/api/v1/rules", timeout=5))
            )
            health = {r["name"]: r["health"] for g in rules["data"]["groups"] for r in g["rules"]}
            assert health and set(health.values()) == {"ok"}, health
    finally:
        stop.set()
        await feeder
        await sidecar.stop(snapshot=False)


def dashboard_queries() -> list[tuple[str, str, list[str]]]:
    """(where, PromQL, the templates whose ``{{label}}``s its series must carry) for every query of
    the dashboard, its variables filled in as Grafana would for this job and every engine."""
    dash = json.loads(DASHBOARD.read_text())
    found: list[tuple[str, str, list[str]]] = []
    for p in dash["panels"]:
        for t in p["targets"]:
            found.append((f"panel {p['title']!r} {t['refId']}", t["expr"], [t.get("legendFormat", "")]))
    for a in dash["annotations"]["list"]:
        found.append(
            (f"annotation {a['name']!r}", a["expr"], [a.get("titleFormat", ""), a.get("textFormat", "")])
        )
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
            assert m, v["definition"]
            found.append((f"variable {v['name']!r}", m[1], ["{{" + m[2] + "}}"]))
    fill = {"$__rate_interval": "5s", "$job": JOB, "$engine": ".*"}
    out = []
    for where, expr, templates in found:
        for var, value in fill.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{where}: a variable left unfilled in {expr}"
        out.append((where, expr, templates))
    return out


async def test_every_dashboard_query_returns_series_with_the_labels_its_legend_names(tmp_path: Path) -> None:
    _prometheus()
    config = SidecarConfig(
        engine_listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        state_dir=str(tmp_path / "state"),
        decision_tick_s=0.05,
    )
    sidecar = Sidecar(config=config)
    await sidecar.start()
    # What only a broker, a flapping policy or a bad engine produce, set through the same objects:
    # the fleet link's metrics (no broker here) and a switch.
    fleet = FleetMetrics(sidecar.registry)
    fleet.connected.set(1)
    fleet.policy_version.set(3)
    fleet.malformed.labels("policy", "schema").inc()
    sidecar.metrics.switches.labels("engine-0").inc()
    engine = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello("engine-0")))
    bad = TestEngine(sidecar.engine_target, pb.EngineMessage(hello=hello("engine-1")))
    stop = asyncio.Event()

    async def feed() -> None:
        t = 1.0
        while not stop.is_set():
            t += 0.1
            engine.report(
                step(t=t, accepted=[2, 1, 0]), step(t=t + 0.05, accepted=[1, 1], method="ngram", k=4)
            )
            await asyncio.sleep(0.1)

    try:
        await engine.directive()
        await bad.directive()
        bad.report(step(t=1.0, accepted=[3], k=2, drafted=2))  # more accepted than drafted: rejected
        feeder = asyncio.create_task(feed())
        target = sidecar.metrics_url.removeprefix("http://").removesuffix("/metrics")
        with prometheus(target, tmp_path) as url:
            queries = dashboard_queries()
            assert len(queries) >= 20
            pending = {where: (expr, templates) for where, expr, templates in queries}
            results: dict[str, list[dict[str, object]]] = {}
            changed = False
            deadline = time.monotonic() + 90
            while pending and time.monotonic() < deadline:
                seen = await asyncio.to_thread(query, url, "speccontrol_fleet_policy_version == 3")
                if not changed and seen:
                    fleet.policy_version.set(4)  # after Prometheus has seen 3: a change to annotate
                    changed = True
                for where, (expr, _) in list(pending.items()):
                    got = await asyncio.to_thread(query, url, expr)
                    if got:
                        results[where] = got
                        del pending[where]
                await asyncio.sleep(0.5)
            assert not pending, f"queries that never returned a series: {pending}"
            for where, expr, templates in queries:
                for template in templates:
                    for name in re.findall(r"\{\{\s*(.+?)\s*\}\}", template):
                        missing = [r["metric"] for r in results[where] if name not in r["metric"]]  # type: ignore[operator]
                        assert not missing, f"{where}: {{{{{name}}}}} names no label of {missing[0]} ({expr})"
            (annotation,) = [r for w, r in results.items() if w.startswith("annotation")]
            assert [r["metric"]["version"] for r in annotation] == ["4"]  # type: ignore[index]
        stop.set()
        await feeder
    finally:
        stop.set()
        await engine.close()
        await bad.close()
        await sidecar.stop(snapshot=False)
