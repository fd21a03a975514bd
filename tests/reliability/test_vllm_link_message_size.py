"""The vLLM plugin's link never sends a batch the sidecar would refuse unread (too many bytes or steps).

A real sidecar with its smallest message limit (128 KiB) and the plugin's link (threads, sync gRPC)
over a real socket. Batches of wide steps (hundreds of requests with vLLM-length request ids) used to
go out up to ``batch_max`` steps whatever their size: gRPC refused the message before the sidecar read
it (RESOURCE_EXHAUSTED), so it was never acknowledged, and every resend after the reconnect failed the
same way until the keep buffer evicted it. Now the link sizes each batch to what the sidecar says it
takes (``Directive.max_message_bytes`` / ``max_steps_per_batch``) and drops, counted, only a step that
alone exceeds it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from controller.server import SidecarServer as Sidecar
from controller.v1 import controller_pb2 as pb
from controller.vllm.link import SidecarLink
from controller.vllm.record import StepRecord
from tests.integration.test_sidecar_grpc import until
from tests.reliability.test_reconnect_accounting import _config

pytestmark = pytest.mark.integration

LIMIT = 128 * 1024  # the smallest max_message_bytes the sidecar accepts


def _wide(i: int, rows: int) -> StepRecord:
    """A step of ``rows`` requests with ids as long as vLLM's (``cmpl-<32 hex>-0``), ~70 bytes a row."""
    ids = tuple(f"cmpl-{i:016x}{j:016x}-0" for j in range(rows))
    return StepRecord(
        time_s=float(i), duration_s=0.02, batch_size=rows, queue_length=0, queue_wait_s=0.0, scheduled_k=2,
        directive_version=1, request_id=ids, class_names=("code",), class_index=np.zeros(rows, dtype=np.int32),
        method=np.zeros(rows, dtype=np.int8), k=np.full(rows, 2, dtype=np.int32),
        drafted=np.full(rows, 2, dtype=np.int32), accepted=np.ones(rows, dtype=np.int32),
        cf_ngram=np.full(rows, 2, dtype=np.int32), finished=np.zeros(rows, dtype=bool),
    )  # fmt: skip


def _hello() -> pb.Hello:
    return pb.Hello(
        engine_id="wide", model="m", max_k=4, arms=[pb.Arm(method="eagle3", k=2)], protocol_version=1,
        max_batch_size=4096,
    )  # fmt: skip


async def test_a_backlog_of_wide_steps_reaches_a_sidecar_with_a_small_message_limit(tmp_path: Path) -> None:
    sc = Sidecar(
        config=_config(tmp_path, max_message_bytes=LIMIT, max_steps_per_batch=64),
        registry=CollectorRegistry(),
    )
    await sc.start()
    # A long flush interval: the whole backlog is queued before the first batch forms, as after an outage.
    link = SidecarLink(
        target=sc.engine_target, hello=_hello(), flush_s=0.5, batch_max=256, backoff_s=(0.02, 0.1)
    )
    wide = _wide(0, 512).to_pb(packed=True).ByteSize()
    assert 256 * wide > 4 * LIMIT  # a batch_max batch of these is far beyond the limit
    n = 300
    try:
        link.start()
        await until(lambda: link.stats().connected)
        for i in range(n):
            assert link.offer(_wide(i, 512))
        await until(lambda: "wide" in sc.engines() and sc.engines()["wide"].loop.totals.steps == n)
        await until(lambda: link.stats().unacked_batches == 0)
        stats = link.stats()
        assert stats.dropped_steps == 0 and stats.evicted_steps == 0
        assert stats.disconnects == 0  # no batch was refused: the stream never broke
        assert sc.engines()["wide"].loop.totals.request_steps == n * 512
    finally:
        await asyncio.to_thread(link.close)
        await sc.stop(snapshot=False)


async def test_a_step_too_large_for_any_batch_is_dropped_counted_and_the_rest_delivered(
    tmp_path: Path,
) -> None:
    sc = Sidecar(config=_config(tmp_path, max_message_bytes=LIMIT), registry=CollectorRegistry())
    await sc.start()
    link = SidecarLink(
        target=sc.engine_target, hello=_hello(), flush_s=0.01, batch_max=256, backoff_s=(0.02, 0.1)
    )
    assert _wide(0, 4000).to_pb(packed=True).ByteSize() > LIMIT
    try:
        link.start()
        await until(lambda: link.stats().connected)
        assert link.offer(_wide(0, 8))
        assert link.offer(_wide(1, 4000))  # alone beyond the sidecar's limit
        assert link.offer(_wide(2, 8))
        await until(lambda: "wide" in sc.engines() and sc.engines()["wide"].loop.totals.steps == 2)
        await until(lambda: link.stats().unacked_batches == 0 and link.stats().queued_steps == 0)
        assert link.stats().dropped_steps == 1 and link.stats().disconnects == 0
        # The sidecar learns of the drop from the next batch's dropped_steps.
        assert link.offer(_wide(3, 8))
        await until(
            lambda: (
                sc.registry.get_sample_value("speccontrol_engine_dropped_steps_total", {"engine": "wide"})
                == 1.0
            )
        )
    finally:
        await asyncio.to_thread(link.close)
        await sc.stop(snapshot=False)
