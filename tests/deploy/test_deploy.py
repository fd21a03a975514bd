"""deploy/: every overlay renders and validates offline; rules, dashboard and autoscalers use real metric names.

Needs kubectl (kustomize v5), kubernetes-validate and promtool; each test skips with the reason when its
tool is missing, unless SPECCONTROL_REQUIRE_DEPLOY_TOOLS (kubectl, kubernetes-validate) or
SPECCONTROL_REQUIRE_SYSTEM_DEPS (promtool) is set: then it fails. scripts/ci_system_deps.sh installs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from controller.config import parse_config
from controller.fleet import FleetMetrics
from controller.metrics import SidecarMetrics
from controller.v1 import controller_pb2 as pb
from controller.wire.address import parse_address
from sim.autoscale import HpaSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ["base", "overlays/keda", "overlays/hpa"]
RULES = DEPLOY / "prometheus" / "speccontrol-rules.yaml"
RULES_TEST = DEPLOY / "prometheus" / "speccontrol-rules.test.yaml"
DASHBOARD = DEPLOY / "grafana" / "speccontrol-dashboard.json"
KEDA_SCHEMA = DEPLOY / "schemas" / "keda-scaledobject-v1alpha1.json"
#: The oldest Kubernetes with native sidecars on by default (SidecarContainers beta, 1.29).
K8S_VERSION = "1.29.0"


def _tool(name: str, env: str) -> str:
    path = shutil.which(name) or next(
        (
            p
            for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}", str(ROOT / ".venv/bin" / name))
            if os.access(p, os.X_OK)
        ),
        None,
    )
    if path is None:
        if os.environ.get(env):
            pytest.fail(f"{name} not found but {env} is set")
        pytest.skip(f"{name} not installed (scripts/ci_system_deps.sh provides it)")
    return path


def kubectl() -> str:
    return _tool("kubectl", "SPECCONTROL_REQUIRE_DEPLOY_TOOLS")


@cache
def _render(overlay: str, binary: str) -> str:
    out = subprocess.run(
        [binary, "kustomize", str(DEPLOY / overlay)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed: {out.stderr}"
    return out.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(_render(overlay, kubectl())) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


# -- rendering and schema validation -------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay: str, tmp_path: Path) -> None:
    validator = _tool("kubernetes-validate", "SPECCONTROL_REQUIRE_DEPLOY_TOOLS")
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(_render(overlay, kubectl()))
    out = subprocess.run(
        [validator, "--strict", "-k", K8S_VERSION, str(rendered)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Core kinds are checked against Kubernetes' schemas; CRDs (PodMonitor, PrometheusRule,
    # ScaledObject) have none there and are checked below.
    for kind in ("deployment/vllm", "service/vllm"):
        assert f"passed for resource {kind}" in out.stdout + out.stderr


def test_strict_validation_catches_a_misspelt_field(tmp_path: Path) -> None:
    validator = _tool("kubernetes-validate", "SPECCONTROL_REQUIRE_DEPLOY_TOOLS")
    docs = render("base")
    dep = one(docs, "Deployment")
    dep["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(dep))
    out = subprocess.run(
        [validator, "--strict", "-k", K8S_VERSION, str(bad)], capture_output=True, text=True, check=False
    )
    assert out.returncode != 0 and "restartPolicyy" in out.stdout + out.stderr


def _keda_validator() -> Any:
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        if os.environ.get("SPECCONTROL_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail("jsonschema not installed but SPECCONTROL_REQUIRE_DEPLOY_TOOLS is set")
        pytest.skip("jsonschema not installed (comes with kubernetes-validate)")
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_keda_scaled_object_matches_its_schema_and_targets_the_deployment() -> None:
    docs = render("overlays/keda")
    so = one(docs, "ScaledObject")
    v = _keda_validator()
    errors = [e.message for e in v.iter_errors(so)]
    assert errors == []
    dep = one(docs, "Deployment")
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    assert so["spec"]["minReplicaCount"] >= 1  # vLLM cold starts take minutes: never scale to zero
    # The schema is closed: a misspelt field or a missing query is an error.
    bad = json.loads(json.dumps(so))
    bad["spec"]["cooldownPeriods"] = 300
    del bad["spec"]["triggers"][0]["metadata"]["query"]
    messages = " | ".join(e.message for e in v.iter_errors(bad))
    assert "cooldownPeriods" in messages and "'query' is a required property" in messages


def test_hpa_targets_the_metric_the_adapter_serves() -> None:
    docs = render("overlays/hpa")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    values = yaml.safe_load((DEPLOY / "overlays/hpa/prometheus-adapter-values.yaml").read_text())
    served = {r["name"]["as"] for r in values["rules"]["custom"]}
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted and wanted <= served
    assert hpa["spec"]["minReplicas"] >= 1


# -- the autoscalers match the simulator ---------------------------------------------------------


def keda_params() -> dict[str, str]:
    doc = yaml.safe_load((DEPLOY / "overlays/keda/params.yaml").read_text())
    data: dict[str, str] = doc["data"]
    return data


def max_num_seqs(docs: list[dict[str, Any]]) -> int:
    engine = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    (flag,) = [a for a in engine["args"] if a.startswith("--max-num-seqs=")]
    return int(flag.split("=", 1)[1])


def _divisor(query: str) -> int:
    m = re.search(r"\)\s*/\s*(\d+)\s*'?$", query.strip())
    assert m, f"no slot divisor in {query!r}"
    return int(m.group(1))


def test_keda_scales_on_the_simulators_two_signals() -> None:
    docs = render("overlays/keda")
    so = one(docs, "ScaledObject")
    assert not [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "speccontrol-autoscaling"
    ]
    triggers = {t["name"]: t for t in so["spec"]["triggers"]}
    assert set(triggers) == {"queue-wait", "slot-utilisation"}
    params = keda_params()
    hpa = HpaSettings()
    assert triggers["queue-wait"]["metadata"]["query"] == params["queueWaitQuery"]
    assert float(triggers["queue-wait"]["metadata"]["threshold"]) == hpa.target_queue_wait_s
    assert "speccontrol:queue_wait_seconds:max" in params["queueWaitQuery"]
    util = triggers["slot-utilisation"]["metadata"]
    assert util["query"] == params["utilisationQuery"] and "vllm:num_requests_running" in util["query"]
    assert hpa.target_utilisation is not None and float(util["threshold"]) == hpa.target_utilisation
    assert _divisor(util["query"]) == max_num_seqs(docs)
    for t in triggers.values():
        # AverageValue of a sum over pods: desired = ceil(sum / target) = ceil(current * mean / target),
        # the ratio rule sim/autoscale.py applies.
        assert t["metricType"] == "AverageValue" and t["metadata"]["query"].startswith("sum(")
        assert t["metadata"]["serverAddress"] == params["serverAddress"]
        assert "PARAM" not in json.dumps(t)


def test_keda_params_are_the_only_place_to_edit(tmp_path: Path) -> None:
    """An overlay that changes params.yaml changes the rendered triggers (nothing else hard-codes them)."""
    overlay = tmp_path / "mine"
    shutil.copytree(DEPLOY / "overlays" / "keda", overlay)
    rel = os.path.relpath(DEPLOY / "base", overlay)
    kust = (overlay / "kustomization.yaml").read_text().replace("../../base", rel)
    (overlay / "kustomization.yaml").write_text(kust)
    params = yaml.safe_load((overlay / "params.yaml").read_text())
    params["data"]["queueWaitQuery"] = 'avg(speccontrol:queue_wait_seconds:max{namespace="llm"})'
    params["data"]["utilisationThreshold"] = "0.7"
    (overlay / "params.yaml").write_text(yaml.safe_dump(params))
    out = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    so = one([d for d in yaml.safe_load_all(out.stdout) if d], "ScaledObject")
    triggers = {t["name"]: t["metadata"] for t in so["spec"]["triggers"]}
    assert triggers["queue-wait"]["query"] == 'avg(speccontrol:queue_wait_seconds:max{namespace="llm"})'
    assert triggers["slot-utilisation"]["threshold"] == "0.7"


def test_hpa_scales_on_the_simulators_two_signals() -> None:
    docs = render("overlays/hpa")
    hpa = one(docs, "HorizontalPodAutoscaler")
    targets = {
        m["pods"]["metric"]["name"]: float(m["pods"]["target"]["averageValue"].removesuffix("m")) / 1000
        for m in hpa["spec"]["metrics"]
    }
    sim = HpaSettings()
    assert targets == {
        "speccontrol_queue_wait_seconds": sim.target_queue_wait_s,
        "vllm_slot_utilisation": sim.target_utilisation,
    }
    values = yaml.safe_load((DEPLOY / "overlays/hpa/prometheus-adapter-values.yaml").read_text())
    (util,) = [r for r in values["rules"]["custom"] if r["name"]["as"] == "vllm_slot_utilisation"]
    assert "vllm:num_requests_running" in util["seriesQuery"]
    assert _divisor(util["metricsQuery"]) == max_num_seqs(docs)


def test_monitoring_labels_are_configurable(tmp_path: Path) -> None:
    base = render("base")
    for kind in ("PodMonitor", "PrometheusRule"):
        for d in (d for d in base if d["kind"] == kind):
            assert d["metadata"]["labels"]["release"] == "prometheus"
    # An overlay sets the label its Prometheus selects by, for the monitoring objects only.
    overlay = tmp_path / "mine"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(DEPLOY / "base", overlay)],
                "labels": [
                    {
                        "pairs": {"release": "kps"},
                        "fields": [
                            {"kind": k, "path": "metadata/labels", "create": True}
                            for k in ("PodMonitor", "PrometheusRule")
                        ],
                    }
                ],
            }
        )
    )
    out = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for d in docs:
        labels = d["metadata"].get("labels", {})
        if d["kind"] in ("PodMonitor", "PrometheusRule"):
            assert labels["release"] == "kps"
        else:
            assert "release" not in labels


def with_component(tmp_path: Path, component: str) -> list[dict[str, Any]]:
    """The base with one of deploy/components, rendered as a user's overlay would."""
    overlay = tmp_path / component
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(DEPLOY / "base", overlay)],
                "components": [os.path.relpath(DEPLOY / "components" / component, overlay)],
            }
        )
    )
    out = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_observe_only_component_leaves_vllm_alone_and_feeds_the_sidecar(tmp_path: Path) -> None:
    from controller.cli import build_parser
    from controller.vllm.settings import enabled

    docs = with_component(tmp_path, "observe-only")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    engine, observer = pod["containers"]
    assert not enabled({e["name"]: e.get("value") or "" for e in engine["env"]})  # the plugin is inert
    args = build_parser().parse_args([*observer["command"][1:], *observer["args"]])
    assert args.func.__name__ == "cmd_observe"
    spec = json.loads(
        next(a for a in engine["args"] if a.startswith("--speculative-config=")).split("=", 1)[1]
    )
    assert (args.method, args.max_k) == (spec["method"], spec["num_speculative_tokens"])
    port = next(p["containerPort"] for p in engine["ports"] if p["name"] == "http")
    assert args.metrics_url == f"http://127.0.0.1:{port}/metrics"
    cfg = parse_config(one(docs, "ConfigMap")["data"]["sidecar.yaml"])
    assert args.sidecar == cfg.engine_listen
    assert any(m["mountPath"] == "/run/speccontrol" for m in observer["volumeMounts"])
    assert args.engine_id == "$(POD_NAME)" and observer["env"][0]["name"] == "POD_NAME"


def test_composite_component_sets_what_per_request_drafting_needs(tmp_path: Path) -> None:
    docs = with_component(tmp_path, "composite")
    engine = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    # Synchronous scheduling and the V1 runner: otherwise the plugin falls back to the K table only.
    assert "--no-async-scheduling" in engine["args"] and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert env["SPECCONTROL_PLUGIN"] == "1"
    base_engine = one(render("base"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--no-async-scheduling" not in base_engine["args"]


def test_pods_run_the_images_built_here() -> None:
    pod = one(render("base"), "Deployment")["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    (engine,) = pod["containers"]
    assert sidecar["image"].split(":")[0].endswith("speccontrol-sidecar")
    assert engine["image"].split(":")[0].endswith("speccontrol-vllm")
    vllm_base = (DEPLOY / "images/vllm/Dockerfile").read_text().split("\nFROM ", 1)[1].split()[0]
    # speccontrol-vllm:<vLLM version>-<speccontrol version>, built FROM vllm/vllm-openai:v<vLLM version>.
    assert vllm_base == "vllm/vllm-openai:v" + engine["image"].split(":")[1].split("-")[0]
    # The sidecar image runs as the user the pod's securityContext names.
    assert "USER 1000:1000" in (DEPLOY / "images/sidecar/Dockerfile").read_text()
    assert sidecar["securityContext"]["runAsUser"] == 1000


def test_pod_wiring() -> None:
    docs = render("base")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (sidecar,) = [c for c in pod["initContainers"] if c["name"] == "speccontrol"]
    (engine,) = pod["containers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    # The sidecar config (the generated ConfigMap) is valid for the sidecar and matches the pod.
    cm = one(docs, "ConfigMap")
    cfg = parse_config(cm["data"]["sidecar.yaml"], source="deploy/base/sidecar.yaml")
    config_vol = next(
        v for v in pod["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"]
    )
    assert any(m["name"] == config_vol["name"] for m in sidecar["volumeMounts"])
    socket_path = parse_address(cfg.engine_listen, field="engine_listen")
    assert isinstance(socket_path, str)
    # Both containers mount the same emptyDir where the socket lives.
    socket_vol = next(v for v in pod["volumes"] if "emptyDir" in v and any(
        m["name"] == v["name"] and socket_path.startswith(m["mountPath"] + "/") for m in sidecar["volumeMounts"]))  # fmt: skip
    assert any(
        m["name"] == socket_vol["name"] and socket_path.startswith(m["mountPath"] + "/")
        for m in engine["volumeMounts"]
    )
    env = {e["name"]: e.get("value") for e in engine["env"]}
    # SPECCONTROL_PLUGIN, not VLLM_PLUGINS (a VLLM_PLUGINS list disables every plugin it leaves out).
    assert env["SPECCONTROL_PLUGIN"] == "1" and "VLLM_PLUGINS" not in env
    assert env["SPECCONTROL_SIDECAR"] == cfg.engine_listen
    # Probes use the sidecar's gRPC health service on its admin port.
    admin = parse_address(cfg.admin_listen, field="admin_listen")
    assert not isinstance(admin, str)
    admin_service = pb.DESCRIPTOR.services_by_name["AdminService"].full_name
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["grpc"] == {"port": admin[1], "service": admin_service}
    metrics_port = parse_address(cfg.metrics_listen, field="metrics_listen")
    assert not isinstance(metrics_port, str)
    ports = {p["name"]: p["containerPort"] for c in (sidecar, engine) for p in c["ports"]}
    assert ports["metrics"] == metrics_port[1] and ports["admin"] == admin[1]
    for pm in (d for d in docs if d["kind"] == "PodMonitor"):
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in ports
        assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels(docs).items()
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert svc["spec"]["selector"].items() <= pod_labels(docs).items()
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports.keys()
    # The API is load-balanced; the admin port is not (each pod's sidecar has its own state): it is
    # reachable per pod through a headless Service.
    api = one(docs, "Service", "vllm")
    assert api.get("spec", {}).get("clusterIP") != "None"
    assert {p["targetPort"] for p in api["spec"]["ports"]} == {"http"}
    admin_svc = one(docs, "Service", "vllm-admin")
    assert admin_svc["spec"]["clusterIP"] == "None"
    assert {p["targetPort"] for p in admin_svc["spec"]["ports"]} == {"admin"}


def pod_labels(docs: list[dict[str, Any]]) -> dict[str, str]:
    labels: dict[str, str] = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    return labels


# -- Prometheus rules ----------------------------------------------------------------------------


def promtool() -> str:
    return _tool("promtool", "SPECCONTROL_REQUIRE_SYSTEM_DEPS")


def test_rules_check() -> None:
    out = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_rules_unit_tests() -> None:
    out = subprocess.run(
        [promtool(), "test", "rules", RULES_TEST.name],
        capture_output=True,
        text=True,
        check=False,
        cwd=RULES_TEST.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_rules_unit_tests_evaluate_the_recording_rules_first() -> None:
    # Unlisted, promtool evaluates the groups in random order at each time: when the alerts came first
    # they saw the last minute's recorded rates and fired a minute late (6 of 40 runs failed).
    groups = [g["name"] for g in yaml.safe_load(RULES.read_text())["groups"]]
    order = yaml.safe_load(RULES_TEST.read_text()).get("group_eval_order")
    assert order == sorted(groups, key=lambda g: not g.endswith(".recording")), (order, groups)


def test_rules_unit_tests_fail_on_a_broken_rule(tmp_path: Path) -> None:
    broken = RULES.read_text().replace("for: 10m", "for: 2h")  # the collapse alert would not fire in time
    (tmp_path / RULES.name).write_text(broken)
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    out = subprocess.run(
        [promtool(), "test", "rules", RULES_TEST.name],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert out.returncode != 0 and "SpeccontrolAcceptanceCollapse" in out.stdout + out.stderr


def test_operator_rule_carries_the_same_groups() -> None:
    plain = yaml.safe_load(RULES.read_text())
    cr = yaml.safe_load((DEPLOY / "base" / "prometheusrule.yaml").read_text())
    assert cr["kind"] == "PrometheusRule"
    assert cr["spec"] == plain
    names = {r.get("alert") for g in plain["groups"] for r in g["rules"]}
    for alert in (
        "SpeccontrolAcceptanceCollapse",
        "SpeccontrolDirectiveStale",
        "SpeccontrolSidecarDown",
        "SpeccontrolSidecarAbsent",
        "SpeccontrolPolicyFlapping",
    ):
        assert alert in names


# -- metric names --------------------------------------------------------------------------------


def exported_names() -> set[str]:
    """Every sample name the sidecar and the fleet link expose."""
    reg = CollectorRegistry()
    SidecarMetrics(registry=reg, clock=lambda: 0.0)
    FleetMetrics(reg)
    # The names a query can select: a family's own name is a series only for gauges (a counter's is
    # ``_total``, a histogram's ``_bucket`` / ``_sum`` / ``_count``), so a bare counter name, which
    # selects nothing in Prometheus, is not taken.
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("", "_sum", "_count"),
    }
    names: set[str] = set()
    for fam in reg.collect():
        names.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
    return names


def recorded_names() -> set[str]:
    return {
        r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r
    }


_METRIC = re.compile(r"\bspeccontrol(?:_[a-z0-9_]+|:[a-z0-9_]+:[a-z0-9_]+)")


def used_names() -> dict[str, set[str]]:
    uses: dict[str, set[str]] = {}
    rules = yaml.safe_load(RULES.read_text())
    uses["rules"] = {m for g in rules["groups"] for r in g["rules"] for m in _METRIC.findall(r["expr"])}
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    uses["dashboard"] = {m for e in exprs for m in _METRIC.findall(e)}
    uses["keda"] = {m for q in keda_params().values() for m in _METRIC.findall(q)}
    adapter = (DEPLOY / "overlays/hpa/prometheus-adapter-values.yaml").read_text()
    uses["adapter"] = set(_METRIC.findall(adapter))
    return uses


def test_every_metric_used_in_deploy_exists() -> None:
    known = exported_names() | recorded_names()
    uses = used_names()
    for where, names in uses.items():
        assert names, f"{where}: no speccontrol metric found (the pattern is broken)"
        assert names <= known, f"{where}: unknown metrics {sorted(names - known)}"
    # The named signals of the issue are all there.
    for needed in (
        "speccontrol_queue_wait_seconds",
        "speccontrol_directive_age_seconds",
        "speccontrol_goodput_tokens_per_second",
    ):
        assert needed in exported_names() and needed in uses["dashboard"]


def test_dashboard_shape() -> None:
    dash = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in dash["panels"]]
    for wanted in (
        "Acceptance rate by arm",
        "Chosen arm over time",
        "Goodput",
        "Queue wait",
        "Directive age",
        "Policy guard events",
    ):
        assert any(t.startswith(wanted) for t in titles), wanted
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
