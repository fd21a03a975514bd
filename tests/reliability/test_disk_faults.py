"""A real ``controllerctl serve`` whose state cannot be written (a full disk) refuses policy changes.

What must hold: a ``policy set`` (default or engine override) whose snapshot cannot be written fails
(``controllerctl`` exits 1 naming the file and why), is not made, and leaves memory and disk agreeing,
so a kill -9 right after the next, successful change restarts on exactly the acknowledged policies.
The full disk is RLIMIT_FSIZE on the sidecar process (a write past it fails with EFBIG, as one past
the free space fails with ENOSPC); the process is root in CI, so a read-only directory cannot be made
by mode bits (``tests/controller/test_sidecar_unit.py`` refuses the write in process instead).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_sidecar_grpc import STATIC_EAGLE3_2
from tests.reliability.serve_process import Serve, ctl
from tests.spawn import limited

pytestmark = pytest.mark.integration

#: Bytes any one file of the sidecar may grow to: the first snapshot and the log fit, a 40 KiB policy
#: document does not.
LIMIT = 32 * 1024


_POPEN = subprocess.Popen


def _limited(args: list[str], *rest: Any, **kwargs: Any) -> subprocess.Popen[Any]:
    return _POPEN(limited(args, limit="RLIMIT_FSIZE", value=LIMIT), *rest, **kwargs)


def _policy(name: str, pad: int = 0) -> str:
    doc = STATIC_EAGLE3_2.replace("name: static-eagle3-2", f"name: {name}")
    return doc + "".join(f"# {'x' * 76}\n" for _ in range(pad // 80))


def test_a_policy_change_the_full_disk_refuses_is_not_made_and_a_kill_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"admin_listen: 127.0.0.1:0\nmetrics_listen: ''\nstate_dir: {state}\nsnapshot_interval_s: 3600\n"
    )
    big, small, engine = (tmp_path / n for n in ("big.yaml", "small.yaml", "engine.yaml"))
    big.write_text(_policy("too-big", pad=40 * 1024))
    small.write_text(_policy("small"))
    engine.write_text(_policy("for-e1"))
    with monkeypatch.context() as m:  # only the sidecar gets the limit, not the controllerctl calls
        m.setattr(subprocess, "Popen", _limited)
        served = Serve(cfg, state)
    try:
        refused = ctl("--admin", served.admin, "policy", "set", str(big))
        assert refused.returncode == 1, refused
        assert "policy not changed: the state could not be written to" in refused.stderr
        assert f"{state / 'sidecar-state.json'}" in refused.stderr and "File too large" in refused.stderr
        assert "Traceback" not in refused.stderr and refused.stderr.count("\n") == 1
        with grpc.insecure_channel(served.admin) as ch:  # overrides of engines not attached: the API
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            admin.SetPolicy(pb.SetPolicyRequest(yaml=engine.read_text(), source="e1", engine_id="e1"))
            for eid in ("e1", "e2"):
                with pytest.raises(grpc.RpcError) as e:
                    admin.SetPolicy(pb.SetPolicyRequest(yaml=big.read_text(), source="big", engine_id=eid))
                assert e.value.code() == grpc.StatusCode.ABORTED
                assert "policy not changed" in (e.value.details() or "")
        listed = json.loads(ctl("--admin", served.admin, "policy", "list", "--json").stdout)
        assert "too-big" not in json.dumps(listed)  # nothing of it was made
        done = ctl("--admin", served.admin, "policy", "set", str(small))
        assert done.returncode == 0, done.stderr
        served.kill9()  # right after the acknowledgement
    finally:
        served.stop()
    again = Serve(cfg, state)
    try:
        got = json.loads(ctl("--admin", again.admin, "policy", "get", "--json").stdout)
        assert (got["name"], int(got["revision"])) == ("small", 2)  # the refused ones took no revision
        e1 = json.loads(ctl("--admin", again.admin, "policy", "get", "--engine", "e1", "--json").stdout)
        assert (e1["name"], int(e1["revision"])) == ("for-e1", 1)
        with grpc.insecure_channel(again.admin) as ch:
            listed = pb_grpc.AdminServiceStub(ch).ListPolicies(pb.ListPoliciesRequest())  # type: ignore[no-untyped-call]
        assert [(h.name, h.revision) for h in listed.history] == [("default", 1)]
        assert [(a.engine_id, a.name) for a in listed.active] == [("", "small"), ("e1", "for-e1")]
    finally:
        assert again.stop() == 0
    log = again.output()
    assert "policy change refused: the state could not be written" in log
    assert "Traceback" not in log
