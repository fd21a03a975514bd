"""AdminService: what ``controllerctl`` calls. A thin adapter over ``Sidecar``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from controller.policy_store import MAX_SOURCE, NoPreviousPolicy, PolicyNotSaved, PolicyRecord
from controller.sidecar import Sidecar
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.wire.names import MAX_ENGINE_ID, escape_text, has_control
from policies.presets import preset_names, preset_text
from policies.spec import PolicyError, parse_policy

Ctx = grpc.aio.ServicerContext[Any, Any]


class AdminService(pb_grpc.AdminServiceServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        #: The tasks serving WatchDecisions streams (see ``end_watches``).
        self._watch_tasks: set[asyncio.Task[Any]] = set()

    async def end_watches(self, timeout_s: float) -> None:
        """End every WatchDecisions stream before the server stops.

        A stream whose watcher does not read is blocked in gRPC's write (flow control); the server's
        stop cancels its calls but not that write, so the task outlives the server and is cancelled
        only as the event loop closes, which gRPC logs as an ERROR with two tracebacks per watcher.
        Cancelled here, before the stop, they end at once; watchers see their stream end as at any
        stop (UNAVAILABLE)."""
        tasks = [t for t in self._watch_tasks if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def _check_engine_id(self, engine_id: str, context: Ctx) -> None:
        if len(engine_id) > MAX_ENGINE_ID:
            self.sidecar.admin_rejected("engine_id_too_long")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"engine_id: longer than {MAX_ENGINE_ID} characters"
            )
        if has_control(engine_id):
            self.sidecar.admin_rejected("control_characters")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"engine_id: holds control characters ({escape_text(engine_id)[:80]})",
            )

    async def _check_rate(self, context: Ctx) -> None:
        if not self.sidecar.take_policy_change():
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"policy changes are limited to {self.sidecar.config.max_policy_changes_per_s:g}/s; retry later",
            )

    async def SetPolicy(self, request: pb.SetPolicyRequest, context: Ctx) -> pb.PolicyInfo:
        await self._check_engine_id(request.engine_id, context)
        if len(request.source) > MAX_SOURCE:
            self.sidecar.admin_rejected("source_too_long")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"source: longer than {MAX_SOURCE} characters"
            )
        if has_control(request.source):  # it is echoed by policy list / get and in the sidecar's log
            self.sidecar.admin_rejected("control_characters")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"source: holds control characters ({escape_text(request.source)[:80]})",
            )
        await self._check_rate(context)
        try:
            rec = self.sidecar.set_policy(request.yaml, source=request.source, engine_id=request.engine_id)
        except PolicyError as e:
            self.sidecar.admin_rejected("invalid_policy")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e).splitlines()[0])
        except PolicyNotSaved as e:  # the sidecar's fault, not the request's: the CLI exits 1
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        return self.sidecar.policy_info(rec)

    async def GetPolicy(self, request: pb.GetPolicyRequest, context: Ctx) -> pb.PolicyInfo:
        await self._check_engine_id(request.engine_id, context)
        return self.sidecar.policy_info(self.sidecar.policy_store.get(request.engine_id))

    async def ListPolicies(self, request: pb.ListPoliciesRequest, context: Ctx) -> pb.ListPoliciesResponse:
        store = self.sidecar.policy_store
        presets = []
        for name in preset_names():
            spec = parse_policy(preset_text(name), source=f"preset:{name}")
            presets.append(self.sidecar.policy_info(PolicyRecord(spec, 0, f"preset:{name}", 0.0)))
        out = pb.ListPoliciesResponse(presets=presets, active=[self.sidecar.policy_info(store.default)])
        # Overrides then history, while they fit half the message limit (each override can be 64 KiB).
        budget = self.sidecar.config.max_message_bytes // 2 - out.ByteSize()
        for field, records in (("active", store.overrides().values()), ("history", store.history())):
            for r in records:
                info = self.sidecar.policy_info(r)
                budget -= info.ByteSize() + 8
                if budget < 0:
                    out.truncated = True
                    return out
                getattr(out, field).append(info)
        return out

    async def RollbackPolicy(self, request: pb.RollbackPolicyRequest, context: Ctx) -> pb.PolicyInfo:
        await self._check_engine_id(request.engine_id, context)
        await self._check_rate(context)
        try:
            rec = self.sidecar.rollback_policy(request.engine_id)
        except NoPreviousPolicy as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except PolicyNotSaved as e:  # the sidecar's fault, not the request's: the CLI exits 1
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        return self.sidecar.policy_info(rec)

    async def GetStatus(self, request: pb.StatusRequest, context: Ctx) -> pb.Status:
        return self.sidecar.status()

    async def ListEngines(self, request: pb.ListEnginesRequest, context: Ctx) -> pb.ListEnginesResponse:
        if request.after_engine_id:
            await self._check_engine_id(request.after_engine_id, context)
        engines, next_offset = self.sidecar.engine_page(
            request.offset, request.limit, request.after_engine_id
        )
        return pb.ListEnginesResponse(
            engines=engines, total=len(self.sidecar.engines()), next_offset=next_offset
        )

    async def WatchDecisions(
        self, request: pb.WatchDecisionsRequest, context: Ctx
    ) -> AsyncIterator[pb.Decision]:
        await self._check_engine_id(request.engine_id, context)
        if self.sidecar.watcher_count >= self.sidecar.config.max_watchers:
            self.sidecar.admin_rejected("too_many_watchers")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.sidecar.config.max_watchers} WatchDecisions streams at a time",
            )
        q = self.sidecar.watch(request.engine_id)
        task = asyncio.current_task()
        if task is not None:
            self._watch_tasks.add(task)
        try:
            while True:
                yield await q.get()
        finally:
            self.sidecar.unwatch(q)
            if task is not None:
                self._watch_tasks.discard(task)
