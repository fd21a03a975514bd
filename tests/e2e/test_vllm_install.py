"""The install check against the real vLLM in the vLLM virtualenv (no engine start): every patch point
the plugin knows matches the installed vLLM, and a deliberately changed method in the real scheduler
module leaves vLLM unpatched with one log line."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.e2e.harness import ROOT, VLLM_PY, checkout_pythonpath, skip_module_without_vllm

skip_module_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

_SCRIPT = r"""
import json, logging, sys
from controller.vllm import compat, plugin

records = []
class Keep(logging.Handler):
    def emit(self, r):
        records.append(r.getMessage())
logging.getLogger("vllm.speccontrol").addHandler(Keep())
out = {"version": compat.installed_version()}
out["install"] = compat.problems(compat.INSTALL_POINTS, version=out["version"])
out["v1_worker"] = compat.problems(compat.V1_WORKER_POINTS, version=None)
out["v1_worker_gap"] = compat.problems(compat.V1_WORKER_GAP_POINTS, version=None)
out["v1_eagle_k"] = compat.problems(compat.V1_EAGLE_K_POINTS, version=None)
out["cpu_async"] = compat.problems(compat.CPU_ASYNC_POINTS, version=None)
out["p_eagle"] = compat.problems(compat.P_EAGLE_POINTS, version=None)
from controller.vllm.v2 import V2_POINTS
out["v2"] = compat.problems(V2_POINTS, version=None)
from vllm.v1.core.sched.scheduler import Scheduler
if sys.argv[1] == "mismatch":
    def update_draft_token_ids(self, drafts, extra):  # vLLM "renamed" it
        return None
    Scheduler.update_draft_token_ids = update_draft_token_ids
before = dict(vars(Scheduler))
plugin.register()
out["patched"] = bool(getattr(Scheduler, "_speccontrol_patched", False))
out["unchanged"] = all(vars(Scheduler).get(k) is v for k, v in before.items())
out["log"] = records
print("RESULT " + json.dumps(out))
"""


def _run(kind: str) -> dict[str, object]:
    env = {
        **os.environ,
        "PYTHONPATH": checkout_pythonpath(),
        "SPECCONTROL_PLUGIN": "1",
        "SPECCONTROL_SIDECAR": "unix:///tmp/speccontrol-install-test.sock",
    }
    r = subprocess.run(
        [str(VLLM_PY), "-c", _SCRIPT, kind], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    got: dict[str, object] = json.loads(line[-1][len("RESULT ") :])
    return got


def test_every_patch_point_matches_the_installed_vllm() -> None:
    got = _run("as-is")
    assert got["install"] == [] and got["v1_worker"] == [] and got["cpu_async"] == [], got
    assert got["v1_worker_gap"] == [] and got["v1_eagle_k"] == [], got
    assert got["p_eagle"] == [] and got["v2"] == [], got
    assert got["patched"] is True, got
    # scripts/e2e_vllm_033.sh names the vLLM it lays over the virtualenv: that one is under test
    wanted = os.environ.get("SPECCONTROL_E2E_VLLM_VERSION")
    assert wanted in (None, got["version"]), got["version"]


def test_a_changed_method_in_the_real_module_leaves_vllm_unpatched() -> None:
    got = _run("mismatch")
    assert got["patched"] is False and got["unchanged"] is True, got
    log = got["log"]
    assert isinstance(log, list) and len(log) == 1, log
    assert "Scheduler.update_draft_token_ids: expected parameters (self, draft_token_ids" in log[0], log
