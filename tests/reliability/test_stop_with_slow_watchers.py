"""A real ``controllerctl serve`` stopped (SIGTERM) while WatchDecisions clients do not read.

What must hold: the shutdown is clean (exit 0, the final snapshot written) and logs no ERROR and
no traceback. It logged ``Exception not handled by _handle_exceptions in servicer method
[/controller.v1.AdminService/WatchDecisions]`` with two ``CancelledError`` tracebacks per watcher
whose stream was blocked on flow control: the server's stop did not end those writes, and the
event loop's close cancelled them.
"""

from __future__ import annotations

import asyncio
import select
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_sidecar_grpc import WAIT_S, hello
from tests.reliability.serve_process import ENV, REPO, Serve

pytestmark = pytest.mark.integration

# A watcher that reads one decision (its stream is registered) and then no more: once gRPC's
# receive window (64 KiB by default) is full, the sidecar's writes to it block.
NOT_READING = """
import asyncio, sys
import grpc
from controller.v1 import controller_pb2 as pb, controller_pb2_grpc as pb_grpc
async def main():
    async with grpc.aio.insecure_channel(sys.argv[1]) as ch:
        call = pb_grpc.AdminServiceStub(ch).WatchDecisions(pb.WatchDecisionsRequest())
        await call.read()
        print("watching", flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""

ENGINES = 300


async def attach_engines(target: str, n: int, *, prefix: str = "w-") -> None:
    """Attach ``n`` engines, each until its first directive (every attach sends watchers a decision)."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.EngineServiceStub(ch)  # type: ignore[no-untyped-call]

        async def one(i: int) -> None:
            h = hello(f"{prefix}{i}")
            h.instance_id = uuid.uuid4().hex

            async def messages() -> AsyncIterator[pb.EngineMessage]:
                yield pb.EngineMessage(hello=h)
                await asyncio.sleep(0.2)

            call = stub.Attach(messages())
            async for _ in call:
                break
            call.cancel()

        for first in range(0, n, 25):
            await asyncio.gather(*(one(i) for i in range(first, min(n, first + 25))))


def test_sigterm_with_watchers_that_do_not_read_logs_no_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"engine_listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\nstate_dir: {state}\n"
        f"max_engines: {ENGINES + 10}\n"
    )
    serve = Serve(cfg, state)
    watchers: list[subprocess.Popen[str]] = []
    try:
        for _ in range(3):
            w = subprocess.Popen(
                [sys.executable, "-c", NOT_READING, serve.admin],
                cwd=REPO,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            watchers.append(w)
        # Engines attach until every watcher has had a decision (its stream is registered), then more.
        waiting = {w.stdout.fileno(): w for w in watchers if w.stdout is not None}
        deadline = time.monotonic() + WAIT_S
        round_ = 0
        while waiting and time.monotonic() < deadline:
            asyncio.run(attach_engines(serve.engine, 1, prefix=f"first-{round_}-"))
            round_ += 1
            ready, _, _ = select.select(list(waiting), [], [], 0.2)
            for fd in ready:
                pipe = waiting.pop(fd).stdout
                assert pipe is not None and pipe.readline().strip() == "watching"
        assert not waiting, "a watcher never received a decision"
        asyncio.run(attach_engines(serve.engine, ENGINES))
        time.sleep(0.5)  # the decisions queued for the watchers are being written
        t0 = time.monotonic()
        assert serve.stop() == 0
        stop_s = time.monotonic() - t0
    finally:
        serve.stop()
        for w in watchers:
            w.kill()
            w.communicate(timeout=WAIT_S)  # also closes its pipe (left open, a later test's GC warns)
    out = serve.output()
    assert f"engine w-{ENGINES - 1} attached" in out
    assert "stopping: writing the final snapshot" in out
    assert " ERROR " not in out and "Traceback" not in out, out[-3000:]
    assert (state / "sidecar-state.json").exists()
    assert stop_s < WAIT_S
