"""A small typed async client for the sidecar's AdminService (what ``controllerctl`` uses).

    async with AdminClient(target="127.0.0.1:50062", token=token) as admin:
        info = await admin.set_policy(text, source="my.yaml", engine_id="engine-0")

``token`` is the admin bearer token (sent on every call when given); ``tls`` makes the channel TLS,
with a client certificate for mTLS. Errors are the gRPC ones (``grpc.aio.AioRpcError``); callers
decide how to show them.

What must hold: the client takes any response a sidecar may send. A sidecar's responses are bounded
by its ``max_message_bytes`` (up to ``MAX_RESPONSE_BYTES``; a page of engines a quarter of it, a
policy list half), not by gRPC's 4 MiB client default, which refused them ("Received message larger
than max") once a sidecar configured above 16 MiB held enough engines or per-engine policies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType

import grpc

from controller.auth import ClientTLS, bearer_metadata, channel_credentials, channel_options
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc

#: The largest response taken: the largest ``max_message_bytes`` a sidecar's config allows.
MAX_RESPONSE_BYTES = 256 * 1024 * 1024


class AdminClient:
    def __init__(
        self, *, target: str, timeout: float = 5.0, token: str = "", tls: ClientTLS | None = None
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.tls = tls
        self._md = bearer_metadata(token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.AdminServiceStub | None = None

    async def __aenter__(self) -> AdminClient:
        options = [*channel_options(self.tls), ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)]
        if self.tls is not None:
            creds = channel_credentials(self.tls)
            self._channel = grpc.aio.secure_channel(self.target, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=options)
        self._stub = pb_grpc.AdminServiceStub(self._channel)  # type: ignore[no-untyped-call]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._channel is not None:
            await self._channel.close(None)
        self._channel = self._stub = None

    @property
    def stub(self) -> pb_grpc.AdminServiceStub:
        if self._stub is None:
            raise RuntimeError("AdminClient is used outside 'async with'")
        return self._stub

    async def set_policy(self, yaml_text: str, *, source: str = "", engine_id: str = "") -> pb.PolicyInfo:
        req = pb.SetPolicyRequest(yaml=yaml_text, source=source, engine_id=engine_id)
        out: pb.PolicyInfo = await self.stub.SetPolicy(req, timeout=self.timeout, metadata=self._md)
        return out

    async def get_policy(self, engine_id: str = "") -> pb.PolicyInfo:
        out: pb.PolicyInfo = await self.stub.GetPolicy(
            pb.GetPolicyRequest(engine_id=engine_id), timeout=self.timeout, metadata=self._md
        )
        return out

    async def list_policies(self) -> pb.ListPoliciesResponse:
        out: pb.ListPoliciesResponse = await self.stub.ListPolicies(
            pb.ListPoliciesRequest(), timeout=self.timeout, metadata=self._md
        )
        return out

    async def rollback_policy(self, engine_id: str = "") -> pb.PolicyInfo:
        req = pb.RollbackPolicyRequest(engine_id=engine_id)
        out: pb.PolicyInfo = await self.stub.RollbackPolicy(req, timeout=self.timeout, metadata=self._md)
        return out

    async def status(self) -> pb.Status:
        out: pb.Status = await self.stub.GetStatus(
            pb.StatusRequest(), timeout=self.timeout, metadata=self._md
        )
        return out

    async def engines(self) -> list[pb.EngineStatus]:
        """Every attached engine, page after page (a page holds what fits a quarter of the sidecar's
        message limit: one call listed 331 of 607 engines, and said nothing of the rest)."""
        engines: dict[str, pb.EngineStatus] = {}
        after = ""
        while True:
            # Each page starts after the last id of the one before (not at a position: engines attaching
            # or evicted between pages shifted positions, so some came twice and others never).
            out: pb.ListEnginesResponse = await self.stub.ListEngines(
                pb.ListEnginesRequest(after_engine_id=after), timeout=self.timeout, metadata=self._md
            )
            engines.update((e.engine_id, e) for e in out.engines)
            last = max((e.engine_id for e in out.engines), default="")
            # (a page that does not move on would loop forever: a sidecar's bug, not a reason to hang)
            if not out.next_offset or last <= after:
                return sorted(engines.values(), key=lambda e: e.engine_id)
            after = last

    async def watch_decisions(self, engine_id: str = "") -> AsyncIterator[pb.Decision]:
        """Every decision change (all engines, or one); runs until the caller stops iterating."""
        call = self.stub.WatchDecisions(pb.WatchDecisionsRequest(engine_id=engine_id), metadata=self._md)
        try:
            async for d in call:
                yield d
        finally:
            call.cancel()
