"""Report batches of every size an engine may send, through the real gRPC ingest, for every granularity
and every preset: the stream stays up, every step is applied, and the engine keeps getting directives.

Regression: a batch-granular engine sending 64 or more steps in one report batch killed its stream
(``OverflowError`` in the default policy's int8 index arithmetic); earlier tests sent 1-8 steps.
Sizes: 1..1,024 steps a batch (the sidecar's limit) and 1..512 requests a step, kept under the gRPC
message limit (at most 32,768 request rows a batch, ~1 MB in columns).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller.config import SidecarConfig
from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.wire.codec import request_columns, request_steps
from policies.presets import preset_names, preset_text
from tests.integration.test_sidecar_grpc import TestEngine, until

pytestmark = pytest.mark.integration

MAX_ROWS = 32_768
GRANULARITIES = {
    "batch_step": pb.GRANULARITY_BATCH_STEP,
    "request_k": pb.GRANULARITY_REQUEST_K,
    "request_method": pb.GRANULARITY_REQUEST_METHOD,
}


def hello(engine_id: str, granularity: int) -> pb.Hello:
    arms = [pb.Arm(method="eagle3", k=k) for k in (1, 2, 3, 4)]
    if granularity == pb.GRANULARITY_REQUEST_METHOD:
        arms += [pb.Arm(method="ngram", k=k) for k in (2, 4)]
    arms.append(pb.Arm(method="off"))
    return pb.Hello(
        engine_id=engine_id,
        model="tiny",
        max_k=4,
        arms=arms,
        granularity=granularity,
        max_batch_size=512,
        engine_version="test 0",
        protocol_version=1,
        counterfactual_methods=["ngram"] if granularity == pb.GRANULARITY_REQUEST_METHOD else [],
    )


def report_steps(
    n_steps: int, n_requests: int, granularity: int, columns: bool, seed: int
) -> list[pb.StepReport]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_steps):
        n = n_requests
        if granularity == pb.GRANULARITY_BATCH_STEP:
            ks = np.full(n, int(rng.integers(0, 5)))
            methods = ["eagle3" if ks[0] else "off"] * n
        else:
            ks = rng.integers(0, 5, n)
            pick = rng.integers(0, 2, n) if granularity == pb.GRANULARITY_REQUEST_METHOD else np.zeros(n, int)
            methods = [
                ("off" if k == 0 else ("eagle3", "ngram")[p])
                for k, p in zip(ks.tolist(), pick.tolist(), strict=True)
            ]
        drafted = rng.integers(0, ks + 1)
        accepted = rng.integers(0, drafted + 1)
        cf = (
            {"ngram": rng.integers(-1, 5, n).tolist()}
            if granularity == pb.GRANULARITY_REQUEST_METHOD
            else None
        )
        fields = {
            "request_ids": [f"r{j}" for j in range(n)],
            "classes": [("chat", "code", "default")[c] for c in rng.integers(0, 3, n)],
            "methods": methods,
            "ks": ks.tolist(),
            "drafted": drafted.tolist(),
            "accepted": accepted.tolist(),
            "counterfactual": cf,
        }
        step = pb.StepReport(
            time_s=1.0 + i * 0.02,
            duration_s=0.005 + 0.0002 * n,
            batch_size=n,
            queue_length=int(rng.integers(0, 50)),
            queue_wait_s=float(rng.random()),
            scheduled_k=int(ks.max()),
        )
        if columns:
            step.columns.CopyFrom(request_columns(**fields))
        else:
            step.requests.extend(request_steps(**fields))
        out.append(step)
    return out


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    config = SidecarConfig(
        engine_listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        metrics_listen="",
        state_dir=str(tmp_path / "state"),
        decision_tick_s=0.02,
        max_policy_changes_per_s=1000.0,
    )
    sc = Sidecar(config=config, registry=CollectorRegistry())
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


@st.composite
def batch_shapes(draw: st.DrawFn) -> tuple[int, int]:
    n_steps = draw(st.integers(1, 1024))
    return n_steps, draw(st.integers(1, min(512, MAX_ROWS // n_steps)))


_counter = iter(range(1_000_000))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    shape=batch_shapes(),
    granularity=st.sampled_from(sorted(GRANULARITIES)),
    preset=st.sampled_from(preset_names()),
    columns=st.booleans(),
)
@example(shape=(1024, 32), granularity="batch_step", preset="default", columns=True)
@example(shape=(1024, 32), granularity="request_k", preset="default", columns=True)
@example(shape=(1024, 32), granularity="request_method", preset="default", columns=True)
@example(shape=(64, 512), granularity="batch_step", preset="default", columns=False)
@example(shape=(1, 512), granularity="request_method", preset="default", columns=True)
async def test_any_report_batch_size_is_applied_and_the_stream_stays_up(
    sidecar: Sidecar, shape: tuple[int, int], granularity: str, preset: str, columns: bool
) -> None:
    n_steps, n_requests = shape
    engine_id = f"e{next(_counter)}"
    async with grpc.aio.insecure_channel(sidecar.admin_target) as ch:
        admin = pb_grpc.AdminServiceStub(ch)  # type: ignore[no-untyped-call]
        await admin.SetPolicy(pb.SetPolicyRequest(yaml=preset_text(preset), source=f"preset:{preset}"))
    eng = TestEngine(
        sidecar.engine_target, pb.EngineMessage(hello=hello(engine_id, GRANULARITIES[granularity]))
    )
    try:
        await eng.directive()
        eng.report(*report_steps(n_steps, n_requests, GRANULARITIES[granularity], columns, seed=n_steps))
        await until(lambda: sidecar.engines()[engine_id].loop.totals.steps == n_steps)
        # The stream is still up and applying: a following batch is applied too.
        eng.report(*report_steps(1, 1, GRANULARITIES[granularity], columns, seed=0))
        await until(lambda: sidecar.engines()[engine_id].loop.totals.steps == n_steps + 1)
        assert sidecar.engines()[engine_id].connected
        assert sidecar.engines()[engine_id].loop.totals.request_steps == n_steps * n_requests + 1
        assert sidecar.engines()[engine_id].directive is not None
    finally:
        await eng.close()
