"""kill -9 of a real ``controllerctl serve`` at many points of a stream of admin writes loses nothing.

What must hold after every restart: the sidecar starts; every policy change acknowledged before the kill
is there at its revision (the default policy, its rollback history, each engine override); revisions
never go back or repeat; a change in flight at the kill is either wholly there (at the next revision) or
not at all; the snapshot is never moved aside (no ``.corrupt-``/``.partial-`` copy: with atomic writes a
kill cannot leave a half-written one), an engine's learned statistics restore, its step count never goes
back, and temporary files a kill left mid-write do not pile up in the state directory (they did, one per
kill that landed inside a write; two more tests here kill a writer inside its write deterministically,
at its fsyncs, and at random moments of back-to-back 1 MB snapshot writes).

The kills land after 0 to 300 ms (right after a policy change's acknowledgement included) while an engine
streams and snapshots are written every 0.1 s, and while a SetPolicy is in flight. Only states and
counts are asserted, never timings.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from controller.embedded.core import EngineSettings
from controller.embedded.engine import EmbeddedEngine, LinkSettings
from controller.embedded.workload import demo_workload
from controller.snapshot import SnapshotStore
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from policies.presets import preset_text
from tests.integration.test_sidecar_grpc import WAIT_S, until
from tests.reliability.serve_process import ENV, REPO, Serve

pytestmark = pytest.mark.integration

#: Delays (s) between the last acknowledged write and the kill: 0 is "right after a policy change".
DELAYS = (0.0, 0.0, 0.002, 0.01, 0.03, 0.05, 0.08, 0.12, 0.17, 0.23, 0.3, 0.0, 0.06, 0.15)
#: Kill points (indices into DELAYS) where a SetPolicy is still in flight at the kill.
IN_FLIGHT = {3, 7, 11}
HISTORY = 20
GHOSTS = ("g1", "g2")  # engines with overrides that never attach (their overrides still persist)


def _policy(name: str) -> str:
    return (
        "apiVersion: speccontrol/v1\nkind: Policy\n"
        f"metadata:\n  name: {name}\n"
        "spec:\n  algorithm:\n    name: static\n    params:\n      arm: 'eagle3:2'\n"
        "  decision_interval_s: 0.05\n  directive_ttl_s: 10.0\n  min_dwell_s: 0.0\n"
    )


@dataclass
class _Slot:
    """What the test knows an engine's (or the default's) policy is: (revision, name), newest last."""

    current: tuple[int, str] | None
    history: list[tuple[int, str]] = field(default_factory=list)
    #: The highest revision this slot ever acknowledged (an override's revisions go on past it).
    high: int = 0


class _Model:
    """The acknowledged policy changes, as the policy store applies them."""

    def __init__(self) -> None:
        self.slots: dict[str, _Slot] = {"": _Slot((1, "default"), high=1)}

    def set(self, eid: str, info: pb.PolicyInfo) -> None:
        s = self.slots.setdefault(eid, _Slot(None))
        assert info.revision > s.high, (eid, info.revision, s.high)  # never back, never repeated
        if s.current is not None:
            s.history = [*s.history, s.current][-HISTORY:]
        s.current, s.high = (info.revision, info.name), info.revision

    def rollback(self, eid: str, info: pb.PolicyInfo) -> None:
        s = self.slots[eid]
        if not s.history:  # an override with no earlier revision is removed
            assert eid and info.engine_id == "", info
            s.current = None
            return
        prev = s.history.pop()
        assert (info.revision, info.name) == (s.high + 1, prev[1]), (eid, info, prev, s.high)
        s.current, s.high = (info.revision, info.name), info.revision

    def can_roll_back(self, eid: str) -> bool:
        s = self.slots.get(eid)
        return s is not None and s.current is not None and (bool(s.history) or eid != "")


@pytest.fixture
def sock_dir(short_tmp_path: Path) -> Path:
    return short_tmp_path  # (tests/conftest.py: a socket path holds 107 bytes)


async def _check(admin: pb_grpc.AdminServiceStub, model: _Model) -> None:
    """The restarted sidecar holds exactly the acknowledged policies, revisions and history."""
    got = await admin.GetPolicy(pb.GetPolicyRequest())
    assert (got.revision, got.name) == model.slots[""].current
    listed = await admin.ListPolicies(pb.ListPoliciesRequest())
    assert not listed.truncated
    assert [(h.revision, h.name) for h in listed.history] == list(reversed(model.slots[""].history))
    overrides = {a.engine_id: (a.revision, a.name) for a in listed.active if a.engine_id}
    want = {e: s.current for e, s in model.slots.items() if e and s.current is not None}
    assert overrides == want


def _rounds(state: Path) -> int:
    """The rounds engine k0's learner has run, as the snapshot on disk holds them (0: not there yet)."""
    doc = json.loads((state / "sidecar-state.json").read_text())
    k0 = doc["state"]["engines"].get("k0")
    return int(k0["loop"]["rounds"]) if k0 else 0


async def _write(admin: pb_grpc.AdminServiceStub, model: _Model, rng: random.Random, n: int) -> None:
    """One acknowledged admin write: a default or engine policy set, or a rollback."""
    eid = rng.choice(("", "", *GHOSTS))
    if rng.random() < 0.35 and model.can_roll_back(eid):
        model.rollback(eid, await admin.RollbackPolicy(pb.RollbackPolicyRequest(engine_id=eid)))
    else:
        name = f"p{n}"
        model.set(
            eid, await admin.SetPolicy(pb.SetPolicyRequest(yaml=_policy(name), source=name, engine_id=eid))
        )


async def test_kill_9_at_many_points_loses_no_acknowledged_write(tmp_path: Path, sock_dir: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"engine_listen: unix://{sock_dir}/engine.sock\n"
        "admin_listen: 127.0.0.1:0\n"
        "metrics_listen: ''\n"
        f"state_dir: {state}\n"
        "decision_tick_s: 0.02\n"
        "snapshot_interval_s: 0.1\n"  # a snapshot write is under way at many of the kills
        "ack_interval_s: 0.05\n"
        "max_policy_changes_per_s: 1000\n"
    )
    log = tmp_path / "serve.log"
    rng = random.Random(20261206)
    model = _Model()
    served = await asyncio.to_thread(Serve, cfg, state, log=log)
    engine = EmbeddedEngine(
        target=served.engine,
        settings=EngineSettings(engine_id="k0"),
        workload=demo_workload(seed=0, duration_s=600.0),
        link=LinkSettings(time_scale=1.0, flush_interval_s=0.02, backoff_initial_s=0.02, backoff_max_s=0.2),
    )
    n = 0
    steps_seen = 0
    try:
        await engine.start()
        async with grpc.aio.insecure_channel(served.admin) as ch:
            admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
            # the engine learns under its own override (the default policy), which no later write touches
            learner = preset_text("default")
            model.set(
                "k0", await admin.SetPolicy(pb.SetPolicyRequest(yaml=learner, source="k0", engine_id="k0"))
            )
            # an override its rollback removes: set again later, its revisions must go on, not restart
            model.set("g2", await admin.SetPolicy(pb.SetPolicyRequest(yaml=_policy("p0"), engine_id="g2")))
            model.rollback("g2", await admin.RollbackPolicy(pb.RollbackPolicyRequest(engine_id="g2")))
        for point, delay in enumerate(DELAYS):
            await until(lambda n=20 * (point + 1): engine.stats.sent_steps > n)
            async with grpc.aio.insecure_channel(served.admin) as ch:
                admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
                for _ in range(rng.randint(1, 4)):
                    n += 1
                    await _write(admin, model, rng, n)
                pending = None
                if point in IN_FLIGHT:
                    n += 1
                    name = f"p{n}"
                    pending = (name, admin.SetPolicy(pb.SetPolicyRequest(yaml=_policy(name), source=name)))
                if delay:
                    await asyncio.sleep(delay)
                await asyncio.to_thread(served.kill9)
                if pending is not None:
                    try:
                        model.set("", await pending[1])  # answered before the kill: acknowledged
                        pending = None
                    except grpc.aio.AioRpcError:
                        pass  # the kill came first: the change may be on disk or not, never half
            left = [p for p in state.iterdir() if p.name.endswith(".tmp")]
            learned = _rounds(state)
            served = await asyncio.to_thread(Serve, cfg, state, log=log)
            # the learner's state restored, not started afresh (its counters alone kept)
            assert _rounds(state) >= learned, (_rounds(state), learned)
            async with grpc.aio.insecure_channel(served.admin) as ch:
                admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
                if pending is not None:
                    got = await admin.GetPolicy(pb.GetPolicyRequest())
                    if got.name == pending[0]:  # written before the kill: there whole, at the next revision
                        model.set("", got)
                await _check(admin, model)
                engines = {e.engine_id: e for e in (await admin.ListEngines(pb.ListEnginesRequest())).engines}
                assert engines["k0"].steps >= steps_seen, (engines["k0"].steps, steps_seen)
                steps_seen = engines["k0"].steps
            aside = sorted(p.name for p in state.iterdir() if ".corrupt-" in p.name or ".partial-" in p.name)
            assert aside == []
            # what the kill left mid-write is swept at the start (a live write's file has another name)
            assert not [p for p in left if p.exists()], left
        assert served.stop() == 0
    finally:
        await engine.stop()
        served.stop()
    out = log.read_text(errors="replace")
    assert "Traceback" not in out
    assert "statistics not restored" not in out and "starting clean" not in out
    assert out.count("restored snapshot") == len(DELAYS)


#: A process that writes snapshots in a loop, printing each acknowledged one's number; with an argument
#: N it SIGKILLs itself at its Nth fsync (odd: the new file's, before the rename; even: the directory's).
_WRITER = """
import os, signal, sys
from pathlib import Path
from controller.snapshot import SnapshotStore
kill_at = int(sys.argv[2])
calls = 0
real_fsync = os.fsync
def fsync(fd):
    global calls
    calls += 1
    if calls == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(fd)
os.fsync = fsync
s = SnapshotStore(path=Path(sys.argv[1]))
saved = s.load()
n = saved["n"] if saved else 0
while True:
    n += 1
    assert s.save({"n": n, "pad": "x" * 1_000_000}), s.last_error
    print(n, flush=True)
"""


def _writer(path: Path, kill_at: int = 0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(kill_at)],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )


def _saved(path: Path) -> int:
    """The snapshot's number, loaded as a sidecar start loads it (temporary files swept first)."""
    s = SnapshotStore(path=path)
    state = s.load()
    assert state is not None and state["pad"] == "x" * 1_000_000
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # nothing aside, no temporaries
    return int(state["n"])


@pytest.mark.parametrize(
    "kill_at", [1, 2, 5, 6], ids=["file-fsync-1", "dir-fsync-1", "file-fsync-3", "dir-fsync-3"]
)
def test_kill_9_inside_a_snapshot_write_leaves_the_old_or_the_new_snapshot_whole(
    tmp_path: Path, kill_at: int
) -> None:
    path = tmp_path / "state" / "sidecar-state.json"
    p = _writer(path)  # a first snapshot (n >= 1) to be replaced
    first = int(p.stdout.readline()) if p.stdout else 0
    p.kill()
    p.communicate(timeout=WAIT_S)
    before = _saved(path)
    assert before >= first
    p = _writer(path, kill_at)
    out, _ = p.communicate(timeout=WAIT_S * 3)
    assert p.returncode == -signal.SIGKILL
    acked = [int(x) for x in out.split()]
    assert len(acked) == (kill_at - 1) // 2  # each save is two fsyncs
    temps = [x for x in path.parent.iterdir() if x.name.endswith(".tmp")]
    # killed before its rename: the new file stays half-made beside the old snapshot
    assert len(temps) == kill_at % 2
    # before the rename the previous one stays; after it, the new one is there, acknowledged or not
    assert _saved(path) == before + len(acked) + (kill_at % 2 == 0)


def test_kill_9_at_any_moment_of_snapshot_writes_loses_no_acknowledged_one(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sidecar-state.json"
    last = 0
    for delay in (0.0, 0.01, 0.03, 0.05, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3):
        p = _writer(path)
        assert p.stdout is not None
        acked = [int(p.stdout.readline())]  # it is writing: kill it 0-300 ms later
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=WAIT_S)
        acked += [int(x) for x in out.split()]
        n = _saved(path)
        assert acked[-1] <= n <= acked[-1] + 1  # every acknowledged one; at most the one in flight more
        assert n > last  # never back
        last = n
