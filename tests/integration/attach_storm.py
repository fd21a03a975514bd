"""A process of engines that attach all at once: ``python -m tests.integration.attach_storm TARGET N``.

It opens N Attach streams on TARGET (200 a connection, under the sidecar's 256), writes each one's
Hello, prints ``sent`` once every Hello is written (or ``not sent: ...`` when that takes longer than
its hang guard), then prints one JSON line: how the first read of each stream ended, ``directive`` or
the status code's name. It holds the streams open until its stdin closes.

Why a process of its own: a test in the sidecar's process shares its event loop, so the sidecar takes
each stream as it comes. Here the test can hold the sidecar's loop while the Hellos arrive, so every
stream waits in gRPC's backlog of streams not yet taken at once, as after a restart under load.
What must hold: it never waits without end (each wait has a guard), and it reports every stream.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys

import grpc

from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from tests.integration.test_sidecar_grpc import WAIT_S, hello

#: Streams per connection (the sidecar's ``grpc.max_concurrent_streams`` is 256).
PER_CONNECTION = 200


def _outcome(result: object) -> str:
    if isinstance(result, pb.Directive):
        return "directive"
    if isinstance(result, grpc.aio.AioRpcError):
        return result.code().name
    return type(result).__name__


async def main(target: str, n: int) -> None:
    # (use_local_subchannel_pool: one connection per channel; same-argument channels share one)
    chans = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(-(-n // PER_CONNECTION))
    ]
    calls = [pb_grpc.EngineServiceStub(chans[i // PER_CONNECTION]).Attach() for i in range(n)]  # type: ignore[no-untyped-call]
    try:
        writes = asyncio.gather(
            *(c.write(pb.EngineMessage(hello=hello(f"storm-{i:05d}"))) for i, c in enumerate(calls)),
            return_exceptions=True,
        )
        try:
            await asyncio.wait_for(writes, WAIT_S * 6)
        except TimeoutError:
            print("not sent: the Hellos were not all written", flush=True)
            return
        print("sent", flush=True)
        try:
            reads = await asyncio.wait_for(
                asyncio.gather(*(c.read() for c in calls), return_exceptions=True), WAIT_S * 6
            )
        except TimeoutError:
            print(json.dumps({"no first read": n}), flush=True)
            return
        print(json.dumps(collections.Counter(_outcome(r) for r in reads)), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        for c in calls:
            c.cancel()
        for ch in chans:
            await ch.close(None)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
