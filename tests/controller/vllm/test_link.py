"""The telemetry link against a real in-process gRPC EngineService (a recording fake sidecar)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from controller.v1 import controller_pb2 as pb
from controller.v1 import controller_pb2_grpc as pb_grpc
from controller.vllm.link import SidecarLink
from controller.vllm.record import StepRecord
from policies.arms import METHOD_CODES, Method

pytestmark = pytest.mark.integration


class FakeSidecar(pb_grpc.EngineServiceServicer):
    def __init__(self, ttl_s: float = 30.0, version: int = 1) -> None:
        self.messages: list[pb.EngineMessage] = []
        self.ttl_s, self.version = ttl_s, version
        self.got = threading.Condition()

    def Attach(self, request_iterator: Iterator[pb.EngineMessage], context: Any) -> Iterator[pb.Directive]:
        first = next(request_iterator)
        self._add(first)
        yield pb.Directive(version=self.version, policy="fake", ttl_s=self.ttl_s, method="eagle3",
                           k_table=[pb.KRange(bs_min=1, bs_max=0, k=2)])  # fmt: skip
        for m in request_iterator:
            self._add(m)

    def _add(self, m: pb.EngineMessage) -> None:
        with self.got:
            self.messages.append(m)
            self.got.notify_all()

    def steps(self) -> list[pb.StepReport]:
        return [s for m in self.messages if m.WhichOneof("body") == "reports" for s in m.reports.steps]


def _serve(fake: FakeSidecar, target: str) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_EngineServiceServicer_to_server(fake, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(target)
    server.start()
    return server


def _record(i: int) -> StepRecord:
    return StepRecord(
        time_s=float(i), duration_s=0.01, batch_size=1, queue_length=0, queue_wait_s=0.0, scheduled_k=2,
        directive_version=1, request_id=(f"r{i}",), class_names=("code",), class_index=np.zeros(1, dtype=np.int32),
        method=np.array([0], dtype=np.int8), k=np.array([2], dtype=np.int32),
        drafted=np.array([2], dtype=np.int32), accepted=np.array([1], dtype=np.int32),
        cf_ngram=np.array([2], dtype=np.int32), finished=np.array([False]),
    )  # fmt: skip


def _until(pred: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def _hello() -> pb.Hello:
    return pb.Hello(
        engine_id="e", model="m", max_k=4, arms=[pb.Arm(method="eagle3", k=2)], protocol_version=1
    )


def test_hello_then_batched_reports_and_directive(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/s.sock"
    fake = FakeSidecar()
    server = _serve(fake, target)
    link = SidecarLink(target=target, hello=_hello(), flush_s=0.01)
    try:
        link.start()
        _until(lambda: link.fresh_directive() is not None)
        d = link.fresh_directive()
        assert d is not None and d.version == 1 and d.k_for_batch(3, 4) == 2
        for i in range(10):
            assert link.offer(_record(i))
        _until(lambda: len(fake.steps()) == 10)
        assert fake.messages[0].WhichOneof("body") == "hello"
        seqs = [m.reports.sequence for m in fake.messages[1:]]
        assert seqs == list(range(1, len(seqs) + 1))
        s = fake.steps()[3]
        # The columnar form: one packed field per column, classes by index.
        assert not s.requests and s.HasField("columns")
        c = s.columns
        assert list(c.request_id) == ["r3"] and list(c.classes) == ["code"] and list(c.traffic_class) == [0]
        assert list(c.method) == [METHOD_CODES[Method.EAGLE3]] and list(c.k) == [2]
        assert (list(c.drafted), list(c.accepted), list(c.finished)) == ([2], [1], [False])
        assert [(cf.method, list(cf.accepted)) for cf in c.counterfactual] == [("ngram", [2])]
        assert link.stats().connected and link.stats().sent_steps == 10
    finally:
        link.close()
        server.stop(0)


def test_offer_never_blocks_and_drops_are_counted_then_reported(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/s.sock"
    link = SidecarLink(target=target, hello=_hello(), queue_size=16, flush_s=0.01)
    link.start()  # nobody listens yet
    try:
        accepted = [link.offer(_record(i)) for i in range(40)]
        assert accepted.count(True) == 16 and link.stats().dropped_steps == 24
        fake = FakeSidecar()
        server = _serve(fake, target)
        try:
            _until(lambda: len(fake.steps()) == 16)
            assert sum(m.reports.dropped_steps for m in fake.messages[1:]) == 24
        finally:
            server.stop(0)
    finally:
        link.close()


def test_steps_still_queued_at_close_are_counted_as_dropped(tmp_path: Path) -> None:
    # Every offered step is sent, resent or counted: steps offered just before shutdown to a sidecar
    # that is not there were neither sent nor counted.
    link = SidecarLink(target=f"unix://{tmp_path}/nobody.sock", hello=_hello(), queue_size=64, flush_s=0.01)
    link.start()
    assert all(link.offer(_record(i)) for i in range(40))
    link.close()
    st = link.stats()
    assert (st.sent_steps, st.dropped_steps) == (0, 40)


def test_ttl_lapses_to_none_on_the_links_clock(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/s.sock"
    now = [100.0]
    server = _serve(FakeSidecar(ttl_s=5.0), target)
    link = SidecarLink(target=target, hello=_hello(), clock=lambda: now[0])
    try:
        link.start()
        _until(lambda: link.directive() is not None)
        assert link.fresh_directive(now=104.9) is not None
        assert link.fresh_directive(now=105.1) is None
    finally:
        link.close()
        server.stop(0)


def test_reattaches_when_the_sidecar_returns(tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/s.sock"
    server = _serve(FakeSidecar(version=1), target)
    link = SidecarLink(target=target, hello=_hello(), flush_s=0.01, backoff_s=(0.05, 0.2))
    try:
        link.start()
        _until(lambda: link.stats().attaches == 1)
        server.stop(0).wait()
        _until(lambda: not link.stats().connected)
        second = FakeSidecar(version=9)
        server = _serve(second, target)
        _until(lambda: link.stats().attaches == 2)
        d = link.fresh_directive()
        assert d is not None and d.version == 9
        assert second.messages[0].WhichOneof("body") == "hello"
    finally:
        link.close()
        server.stop(0)


def test_the_log_says_attached_only_once_the_sidecar_answers(tmp_path: Path, caplog: Any) -> None:
    # vLLM's log is where a user looks when an engine does not appear in `controllerctl engines`
    # (docs/production.md): a link that never reached its sidecar said "re-attached" when it first did.
    target = f"unix://{tmp_path}/s.sock"
    link = SidecarLink(target=target, hello=_hello(), flush_s=0.01, backoff_s=(0.05, 0.2))
    caplog.set_level("INFO", logger="vllm.speccontrol")
    server = None
    try:
        link.start()  # nobody listens yet
        _until(lambda: "unavailable" in caplog.text)
        server = _serve(FakeSidecar(), target)
        _until(lambda: link.stats().attaches == 1)
        _until(lambda: "attached to the sidecar" in caplog.text)
        assert f"speccontrol: attached to the sidecar at {target}" in caplog.text
        assert "re-attached" not in caplog.text
        server.stop(0).wait()
        _until(lambda: not link.stats().connected)
        server = _serve(FakeSidecar(version=2), target)
        _until(lambda: f"speccontrol: re-attached to the sidecar at {target}" in caplog.text)
    finally:
        link.close()
        if server is not None:
            server.stop(0)


def test_a_link_that_attaches_at_once_says_so(tmp_path: Path, caplog: Any) -> None:
    target = f"unix://{tmp_path}/s.sock"
    server = _serve(FakeSidecar(), target)
    link = SidecarLink(target=target, hello=_hello(), flush_s=0.01)
    caplog.set_level("INFO", logger="vllm.speccontrol")
    try:
        link.start()
        _until(lambda: f"speccontrol: attached to the sidecar at {target}" in caplog.text)
        assert "unavailable" not in caplog.text and "re-attached" not in caplog.text
    finally:
        link.close()
        server.stop(0)
