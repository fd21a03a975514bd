"""docs/production.md, walked as a new user would as far as it goes without a cluster.

What must hold: every `controllerctl` command and flag the doc shows exists and every repository path
it names exists (tests/test_docs.py, for every doc), every preset, alert and plugin variable it names is
real, and every overlay it tells a user to build (its `my-overlay` example with each component, and
the shipped overlays under it) renders with `kubectl kustomize`, validates strictly with
kubernetes-validate, and runs only the images the overlay names (no container left on an unqualified
image). The Kubernetes tools skip as in test_deploy.py when missing.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_deploy import DEPLOY, K8S_VERSION, ROOT, _tool, kubectl
from tests.test_docs import controllerctl_commands, repository_paths

DOC = ROOT / "docs" / "production.md"
TEXT = DOC.read_text(encoding="utf-8")


def test_the_doc_shows_commands() -> None:
    # Each command and flag is checked against the CLI, and each path it names, for every doc alike
    # (tests/test_docs.py); this one is the walk-through, so it must show the commands a user runs.
    assert len(controllerctl_commands(TEXT)) >= 10
    assert len(repository_paths(TEXT)) > 8


def test_presets_alerts_and_variables_the_doc_names_exist() -> None:
    from policies.presets import preset_names

    for name in re.findall(r"policy set ([a-z0-9-]+)", TEXT) + re.findall(
        r"default_policy: ([a-z0-9-]+)", TEXT
    ):
        assert name in preset_names(), name
    rules = (DEPLOY / "prometheus" / "speccontrol-rules.yaml").read_text()
    for alert in re.findall(r"`(Speccontrol[A-Za-z]+)`", TEXT):
        assert f"alert: {alert}" in rules, alert
    src = "\n".join(p.read_text() for p in (ROOT / "controller").rglob("*.py"))
    for var in set(re.findall(r"SPECCONTROL_[A-Z_]+", TEXT)):
        assert var in src, f"{var} is read nowhere in controller/"


def _my_overlay() -> str:
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", TEXT, re.S) if "my-overlay" in b)
    return block


def _render_user_overlay(tmp_path: Path, text: str) -> list[dict[str, Any]]:
    """``text`` as my-overlay/kustomization.yaml beside a copy of deploy/, as the doc lays it out."""
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    (tmp_path / "my-overlay").mkdir()
    (tmp_path / "my-overlay" / "kustomization.yaml").write_text(text)
    out = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path / "my-overlay")], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    (tmp_path / "rendered.yaml").write_text(out.stdout)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _images(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        out += [c["image"] for c in pod.get("containers", []) + pod.get("initContainers", [])]
    return out


@pytest.mark.parametrize(
    ("base", "component"),
    [
        ("overlays/keda", "observe-only"),
        ("overlays/keda", "composite"),
        ("overlays/hpa", "observe-only"),
        ("overlays/hpa", "composite"),
        ("base", None),
    ],
)
def test_the_docs_overlay_renders_validates_and_uses_the_registry(
    tmp_path: Path, base: str, component: str | None
) -> None:
    text = _my_overlay().replace("../deploy/overlays/keda", f"../deploy/{base}")
    if component is None:
        text = re.sub(r"^components:.*\n", "", text, flags=re.M)
    else:
        text = text.replace("../deploy/components/observe-only", f"../deploy/components/{component}")
    docs = _render_user_overlay(tmp_path, text)
    images = _images(docs)
    assert images and all(i.startswith("REGISTRY/speccontrol-") for i in images), images
    if component == "observe-only":  # the observer container the component adds
        assert len([i for i in images if "sidecar" in i]) >= 2
    validator = _tool("kubernetes-validate", "SPECCONTROL_REQUIRE_DEPLOY_TOOLS")
    out = subprocess.run(
        [validator, "--strict", "-k", K8S_VERSION, str(tmp_path / "rendered.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_images_set_in_the_base_would_miss_the_observer(tmp_path: Path) -> None:
    """Why the doc sets images in the user's overlay: the component's container comes after the base."""
    base = DEPLOY / "base" / "kustomization.yaml"
    text = _my_overlay().split("images:")[0]
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    (tmp_path / "deploy" / "base" / "kustomization.yaml").write_text(
        base.read_text() + "images:\n  - {name: speccontrol-sidecar, newName: REGISTRY/speccontrol-sidecar}\n"
    )
    (tmp_path / "my-overlay").mkdir()
    (tmp_path / "my-overlay" / "kustomization.yaml").write_text(text)
    out = subprocess.run(
        [kubectl(), "kustomize", str(tmp_path / "my-overlay")], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    images = _images([d for d in yaml.safe_load_all(out.stdout) if d])
    assert "speccontrol-sidecar:0.1.0" in images


def _check_schedule(spec: dict[str, Any], max_num_seqs: int, where: str) -> None:
    """vLLM's rules for num_speculative_tokens_per_batch_size (vllm/v1/spec_decode/dynamic/utils.py:
    ranges from batch size 1, sorted, not overlapping, K >= 0), plus what the plugin needs: every K
    1..num_speculative_tokens listed (vLLM prepares only those), every batch size up to max_num_seqs."""
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    assert schedule, f"{where}: no num_speculative_tokens_per_batch_size (the K-table plugin would refuse)"
    assert schedule[0][0] == 1, where
    end = 0
    for lo, hi, k in schedule:
        assert lo == end + 1 and lo <= hi and k >= 0, f"{where}: {[lo, hi, k]} after batch size {end}"
        end = hi
    assert end >= max_num_seqs, f"{where}: batch sizes above {end} have no K"
    assert {k for *_, k in schedule} >= set(range(1, spec["num_speculative_tokens"] + 1)), where


def test_the_engine_starts_with_a_schedule_of_every_k() -> None:
    from tests.deploy.test_deploy import one, render

    engine = one(render("base"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    spec = json.loads(
        next(a for a in engine["args"] if a.startswith("--speculative-config=")).split("=", 1)[1]
    )
    (seqs,) = [int(a.split("=")[1]) for a in engine["args"] if a.startswith("--max-num-seqs=")]
    _check_schedule(spec, seqs, "deploy/base/deployment.yaml")
    # The doc's command outside Kubernetes, likewise.
    cmd = next(b for b in re.findall(r"```sh\n(.*?)```", TEXT, re.S) if "vllm serve" in b)
    words = shlex.split(cmd.replace("\\\n", " ").split("\ncontrollerctl")[0])
    doc_spec = json.loads(words[words.index("--speculative-config") + 1])
    _check_schedule(doc_spec, int(words[words.index("--max-num-seqs") + 1]), "docs/production.md")


def test_the_schedule_check_rejects_what_vllm_or_the_plugin_would() -> None:
    for bad in (
        {"num_speculative_tokens": 3},
        {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[2, 8, 3], [9, 8, 1]]},
        {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, 3]]},
        {"num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, 4, 1]]},
    ):
        with pytest.raises(AssertionError):
            _check_schedule(bad, 8, "x")
