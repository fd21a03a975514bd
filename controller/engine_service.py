"""EngineService.Attach: one bidirectional stream per engine, Hello first, then report batches.

A reader task ingests reports as they come; the handler itself only writes what the sidecar queues
for the stream (directives, then the end), so the engine's sends never wait on decisions.

What must hold: a stream holds nothing of the sidecar's (no engine, no queue, no reader) before its
Hello, and waits for that Hello ``HELLO_TIMEOUT_S`` at most: a client that opens Attach and sends
nothing is ended DEADLINE_EXCEEDED and counted (reason ``hello_timeout``), so it cannot hold a
handler for good by answering keepalive pings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from controller.sidecar import EngineSession, Sidecar
from controller.streams import StreamEnd, put_latest
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.validation import TelemetryError, validate_hello
from controller.wire.codec import PACKED_PROTOCOL
from controller.wire.convert import directive_to_pb

log = logging.getLogger(__name__)

#: Seconds a stream may stay open without its first message (the Hello). Engines send it as the first
#: message of every stream, at once (controller.vllm.link, observe, embedded), so this only has to
#: cover a loaded host's scheduling; and it matches ENGINE_KEEPALIVE_S (controller.server), the time
#: a vanished engine's stream lingers anyway, so an idle opener holds a handler no longer than that.
HELLO_TIMEOUT_S = 30.0


class EngineService(pb_grpc.EngineServiceServicer):
    def __init__(self, sidecar: Sidecar, *, hello_timeout_s: float | None = None) -> None:
        self.sidecar = sidecar
        #: None: ``HELLO_TIMEOUT_S`` as it is when a stream opens.
        self.hello_timeout_s = hello_timeout_s

    async def Attach(
        self,
        request_iterator: AsyncIterator[pb.EngineMessage],
        context: grpc.aio.ServicerContext[pb.EngineMessage, pb.Directive],
    ) -> None:
        it = request_iterator.__aiter__()
        wait_s = HELLO_TIMEOUT_S if self.hello_timeout_s is None else self.hello_timeout_s
        try:
            async with asyncio.timeout(wait_s):
                first = await it.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            err = TelemetryError(
                "hello_timeout",
                f"no Hello within {wait_s:g} s of opening the stream (an engine sends its Hello first)",
            )
            self.sidecar.reject(None, err)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{err.reason}: {err}")
        except DecodeError as e:  # (gRPC ended it UNKNOWN, with a traceback in the log)
            err = _not_a_message(e)
            self.sidecar.reject(None, err)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err.reason}: {err}")
        if first.WhichOneof("body") != "hello":
            err = TelemetryError("hello_missing", "the first message of a stream must be a Hello")
            self.sidecar.reject(None, err)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{err.reason}: {err}")
        try:
            info = validate_hello(first.hello)
        except TelemetryError as e:
            self.sidecar.reject(None, e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.reason}: {e}")
        try:
            session = self.sidecar.attach(
                info,
                instance_id=first.hello.instance_id,
                observe_only=first.hello.observe_only,
                plugin_mode=first.hello.plugin_mode,
            )
        except TelemetryError as e:
            self.sidecar.reject(None, e)
            code = {
                "engine_id_in_use": grpc.StatusCode.ALREADY_EXISTS,
                "max_batch_size_over_limit": grpc.StatusCode.FAILED_PRECONDITION,
            }.get(e.reason, grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(code, f"{e.reason}: {e}")
        reader = asyncio.create_task(self._read(it, session), name=f"attach-{info.engine_id}")
        try:
            while True:
                item = await session.queue.get()
                if isinstance(item, StreamEnd):
                    if item.error is not None:
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT, f"{item.error.reason}: {item.error}"
                        )
                    return
                msg = directive_to_pb(item)
                # Read at write time: the newest acknowledgement goes out with every directive.
                msg.acked_sequence = session.acked_sequence
                msg.protocol_version = PACKED_PROTOCOL  # this sidecar reads packed columns
                # What it takes: a larger batch is refused unread (by gRPC, before this service
                # sees it), so the engine could never have it acknowledged.
                msg.max_message_bytes = self.sidecar.config.max_message_bytes
                msg.max_steps_per_batch = self.sidecar.config.max_steps_per_batch
                await context.write(msg)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self.sidecar.detach(session)

    async def _read(self, it: AsyncIterator[pb.EngineMessage], session: EngineSession) -> None:
        end = StreamEnd()
        try:
            async for msg in it:
                body = msg.WhichOneof("body")
                if body == "reports":
                    self.sidecar.ingest(session, msg.reports)
                else:
                    e = TelemetryError(
                        "hello_repeated", f"expected reports after the Hello, got {body or 'nothing'}"
                    )
                    self.sidecar.reject(session.engine, e)
                    raise e
        except TelemetryError as e:
            end = StreamEnd(e)
        except DecodeError as e:  # (it was logged as the sidecar's own failure, with a traceback)
            err = _not_a_message(e)
            self.sidecar.reject(session.engine, err)
            end = StreamEnd(err)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError:
            pass  # the engine went away
        except Exception:
            log.exception(
                "engine %s: report handling failed; closing the stream", session.engine.info.engine_id
            )
            end = StreamEnd(TelemetryError("internal", "the sidecar failed to process a report"))
        # The end must reach the writer even if directives are queued: drop them, they are stale.
        put_latest(session.queue, end)


def _not_a_message(e: DecodeError) -> TelemetryError:
    """A stream message whose bytes are not an EngineMessage: refused and counted like bad telemetry."""
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return TelemetryError("not_a_message", f"a message that is not an EngineMessage ({why})")
