"""deploy/ and docs/production.md checked against what Kubernetes, vLLM and the sidecar really do with them.

What must hold: an autoscaled Deployment carries no ``replicas`` (``kubectl apply`` would scale the fleet
back to it); a PodDisruptionBudget lets drains take one slow-starting vLLM pod at a time without ever
blocking on one replica; every Secret the pod reads is one production.md tells the user to create, with
the key the pod reads, and a gated model gets ``HF_TOKEN``; the admin token file production.md passes to
``controllerctl --token-file`` is one its own commands wrote and put into the Secret; the policy of
roll-out step 2 plays the engine's start-up K at every batch size (so turning the plugin on changes
nothing) and is mounted where the doc's ``default_policy`` names it; the embedded sidecar config passes
``controllerctl config validate`` with its files in place; every SPECCONTROL_* variable a manifest sets
is one the code reads. The Kubernetes tools skip as in test_deploy.py when missing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.test_deploy import DEPLOY, ROOT, one, render, with_component

DOC = ROOT / "docs" / "production.md"
TEXT = DOC.read_text(encoding="utf-8")
AUTOSCALED = ["overlays/keda", "overlays/hpa"]
#: Hugging Face organisations whose models download only with the token of an account that accepted
#: their licence.
GATED = ("meta-llama/", "mistralai/", "google/gemma")


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def engine_args(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    engine = pod_spec(docs)["containers"][0]
    spec = json.loads(
        next(a for a in engine["args"] if a.startswith("--speculative-config=")).split("=", 1)[1]
    )
    (seqs,) = [int(a.split("=")[1]) for a in engine["args"] if a.startswith("--max-num-seqs=")]
    return spec, seqs


def shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", TEXT, re.S)


# -- replicas and disruptions --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", AUTOSCALED)
def test_an_autoscaled_deployment_leaves_the_replica_count_to_the_autoscaler(overlay: str) -> None:
    # kubectl apply sets every field the manifest names: a replicas: 1 there scales a fleet the
    # autoscaler grew back to one pod on each apply (each roll-out step of production.md is one).
    docs = render(overlay)
    assert [d for d in docs if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    assert "replicas" not in one(docs, "Deployment")["spec"]


@pytest.mark.parametrize("overlay", ["base", *AUTOSCALED])
def test_a_disruption_budget_takes_one_pod_at_a_time_and_never_blocks_a_drain(overlay: str) -> None:
    docs = render(overlay)
    pdb = one(docs, "PodDisruptionBudget")
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # maxUnavailable 1: one pod per drain step, and a single replica can still be evicted (a
    # minAvailable of 1 would block every drain of a one-pod fleet); a pod that is not ready may go.
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


# -- Secrets and tokens --------------------------------------------------------------------------


def secrets_read(pod: dict[str, Any]) -> dict[str, tuple[set[str], bool]]:
    """Secret name -> (the keys the pod reads, whether the pod starts without it)."""
    out: dict[str, tuple[set[str], bool]] = {}
    for v in pod["volumes"]:
        if "secret" in v:
            name = v["secret"]["secretName"]
            mounts = [
                m for c in pod["containers"] + pod["initContainers"] for m in c.get("volumeMounts", [])
                if m["name"] == v["name"]
            ]  # fmt: skip
            assert mounts, f"secret volume {v['name']} is mounted nowhere"
            keys = {i["key"] for i in v["secret"].get("items", [])} or {"token"}
            out[name] = (keys, bool(v["secret"].get("optional")))
    for c in pod["containers"] + pod["initContainers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                keys, _ = out.get(ref["name"], (set(), True))
                out[ref["name"]] = (keys | {ref["key"]}, bool(ref.get("optional")))
    return out


def created_secrets() -> dict[str, set[str]]:
    """Secret name -> keys, for every `kubectl create secret generic` production.md shows."""
    out: dict[str, set[str]] = {}
    for block in shell_blocks():
        for line in block.splitlines():
            m = re.search(r"kubectl create secret generic ([a-z0-9-]+)(.*)", line.split("#")[0])
            if m:
                out[m.group(1)] = set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", m.group(2)))
    return out


def test_every_secret_the_pod_reads_is_one_the_doc_creates() -> None:
    pod = pod_spec(render("base"))
    made = created_secrets()
    read = secrets_read(pod)
    assert "speccontrol-admin-token" in read
    for name, (keys, _optional) in read.items():
        assert name in made, f"the pod reads Secret {name}; docs/production.md never creates it"
        assert keys <= made[name], (
            f"Secret {name}: the pod reads {sorted(keys)}, the doc makes {sorted(made[name])}"
        )


def test_a_gated_model_downloads_with_a_token() -> None:
    pod = pod_spec(render("base"))
    engine = pod["containers"][0]
    (model,) = [a.split("=", 1)[1] for a in engine["args"] if a.startswith("--model=")]
    if not model.startswith(GATED):
        pytest.skip(f"{model} is not gated")
    env = {e["name"]: e for e in engine["env"]}
    # huggingface_hub, which vLLM downloads with, reads HF_TOKEN.
    assert "HF_TOKEN" in env, f"{model} is gated: without HF_TOKEN vLLM's download is refused (401)"
    ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] in created_secrets()


def test_the_token_file_controllerctl_uses_is_one_the_doc_writes() -> None:
    """Section 4 runs `controllerctl --token-file token`: section 3 must leave that file behind, holding
    what went into the Secret (a token made inline, `$(openssl rand ...)`, is in no file)."""
    used = set(re.findall(r"--token-file\s+([\w./-]+)", TEXT))
    assert used
    commands = "\n".join(shell_blocks())
    for path in used:
        assert re.search(rf">\s*{re.escape(path)}\b", commands), f"no command writes the token file {path}"
        assert re.search(
            rf"create secret generic speccontrol-admin-token\s+--from-file=token={re.escape(path)}\b",
            commands,
        ), f"the admin token Secret is not made from {path}"


# -- roll-out step 2: the start-up table as a policy ---------------------------------------------


def _vllm_k(schedule: list[list[int]], batch: int) -> int:
    return next(k for lo, hi, k in schedule if lo <= batch <= hi)


def test_the_step_two_policy_plays_the_engines_start_up_table() -> None:
    from policies.arms import OFF, Arm, Method
    from policies.engine import EngineInfo
    from policies.loop import ControlLoop
    from policies.spec import parse_policy

    docs = render("base")
    spec, seqs = engine_args(docs)
    schedule = spec["num_speculative_tokens_per_batch_size"]
    path = DEPLOY / "base" / "startup-schedule.yaml"
    policy = parse_policy(path.read_text(), source=str(path))
    max_k = spec["num_speculative_tokens"]
    # The engine the plugin announces in K-table mode: its method at every K up to the configured one.
    engine = EngineInfo(
        engine_id="vllm-0",
        model="m",
        max_k=max_k,
        arms=(*(Arm(Method(spec["method"]), k) for k in range(1, max_k + 1)), OFF),
        max_batch_size=seqs,
    )
    directive = ControlLoop(spec=policy, engine=engine).decide(0.0)
    wrong = {
        b: (directive.k_for_batch(b, max_k), _vllm_k(schedule, b))
        for b in range(1, seqs + 1)
        if directive.k_for_batch(b, max_k) != _vllm_k(schedule, b)
    }
    assert not wrong, f"batch size: (policy K, start-up K): {dict(list(wrong.items())[:5])}"
    assert directive.method is Method(spec["method"])


def test_the_doc_names_the_step_two_policy_where_the_pod_mounts_it(tmp_path: Path) -> None:
    docs = render("base")
    (named,) = set(re.findall(r"default_policy: (/[\w./-]+)", TEXT))
    pod = pod_spec(docs)
    cm = one(docs, "ConfigMap")
    vol = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"])
    (mount,) = [m["mountPath"] for m in pod["initContainers"][0]["volumeMounts"] if m["name"] == vol["name"]]
    assert named.startswith(mount + "/") and named.removeprefix(mount + "/") in cm["data"]


def _validate(cfg: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "sidecar.yaml"
    f.write_text(cfg)
    return subprocess.run(
        [str(Path(sys.executable).parent / "controllerctl"), "config", "validate", str(f)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.parametrize("step_two", [False, True], ids=["as-shipped", "roll-out-step-2"])
def test_the_embedded_sidecar_config_validates_with_its_files_in_place(
    tmp_path: Path, step_two: bool
) -> None:
    """`controllerctl config validate` on the ConfigMap's sidecar.yaml, every pod path moved under
    tmp_path as the pod's volumes provide it (the token Secret, the emptyDirs, the ConfigMap itself)."""
    docs = render("base")
    cm = one(docs, "ConfigMap")["data"]
    root = tmp_path / "pod"
    for key, text in cm.items():
        (root / "etc/speccontrol").mkdir(parents=True, exist_ok=True)
        (root / "etc/speccontrol" / key).write_text(text)
    (root / "etc/speccontrol-admin").mkdir(parents=True)
    (root / "etc/speccontrol-admin/token").write_text("0123456789abcdef" * 4 + "\n")
    for d in ("run/speccontrol", "var/lib/speccontrol"):
        (root / d).mkdir(parents=True)
    cfg = cm["sidecar.yaml"]
    if step_two:
        (named,) = set(re.findall(r"default_policy: (/[\w./-]+)", TEXT))
        cfg = re.sub(r"^default_policy: .*$", f"default_policy: {named}", cfg, flags=re.M)
    for d in ("/run/speccontrol", "/var/lib/speccontrol", "/etc/speccontrol-admin", "/etc/speccontrol/"):
        cfg = cfg.replace(d, f"{root}{d}")
    out = _validate(cfg, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "startup-schedule" in out.stdout if step_two else "'default'" in out.stdout


# -- environment variables -----------------------------------------------------------------------


def test_every_speccontrol_variable_a_manifest_sets_is_read_by_the_code(tmp_path: Path) -> None:
    src = "\n".join(p.read_text() for p in (ROOT / "controller").rglob("*.py"))
    read = set(re.findall(r"SPECCONTROL_[A-Z0-9_]+", src))
    pods = [pod_spec(render(o)) for o in ("base", *AUTOSCALED)]
    pods += [pod_spec(with_component(tmp_path, c)) for c in ("observe-only", "composite")]
    seen = set()
    for pod in pods:
        for c in pod["containers"] + pod["initContainers"]:
            seen |= {e["name"] for e in c.get("env", []) if e["name"].startswith("SPECCONTROL_")}
    assert seen >= {"SPECCONTROL_PLUGIN", "SPECCONTROL_SIDECAR", "SPECCONTROL_ENGINE_ID"}
    assert seen <= read, f"set in deploy/ but read nowhere in controller/: {sorted(seen - read)}"
