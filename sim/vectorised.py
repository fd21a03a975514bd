"""Vectorised replay of plans fixed in advance (static arms, per-class or per-phase arms, oracles).

When the (method, K) a request uses at each of its positions does not depend on the other requests,
every request's steps follow from its own acceptance arrays alone (``walk``). In a closed loop at
fixed concurrency all running requests advance one step together, so a request's start step is
known from the step counts of the requests before it (``schedule_closed``); the step times then
follow from per-step sums of KV tokens, batched tokens and drafts, priced in one call. No Python
work per step or per request-step.

Semantics are those of ``sim.replay`` (the stepwise engine) exactly; tests hold them equal.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from policies.arms import METHOD_CODES, Method
from policies.engine import Granularity
from sim.costmodel import Profile
from sim.engines import EngineModel
from sim.run import RunResult, Timeline, arm_code
from sim.trace import Trace

_OFF = METHOD_CODES[Method.OFF]


@dataclass(frozen=True, slots=True)
class Rows:
    """Decode request-steps, request-major and in step order within a request."""

    req: np.ndarray
    done: np.ndarray  # tokens the request had before the step
    method: np.ndarray  # int8 method codes
    k: np.ndarray
    emitted: np.ndarray

    @property
    def n(self) -> int:
        return len(self.req)


def selected_acc(trace: Trace, method_flat: np.ndarray) -> np.ndarray:
    """Per output position, the accepted count of the method planned there (0 for ``off``)."""
    out = np.zeros(trace.total_output_tokens, dtype=np.int32)
    for m, a in trace.acc.items():
        sel = method_flat == METHOD_CODES[m]
        out[sel] = a[sel]
    used = set(np.unique(method_flat).tolist()) - {_OFF} - {METHOD_CODES[m] for m in trace.acc}
    if used:
        raise ValueError("the plan uses a method the trace has no acceptance data for")
    return out


def walk(trace: Trace, method_flat: np.ndarray, k_flat: np.ndarray) -> Rows:
    """Every decode step of every request under a per-position plan (method and K at each position).

    A step at position t (``done`` tokens exist, t = done - 1) accepts min(acc[t], K), emits that + 1
    tokens (capped at what remains) and moves on by as much.
    """
    acc = selected_acc(trace, method_flat)
    k_flat = np.where(method_flat == _OFF, 0, k_flat).astype(np.int64)
    base = trace.offsets[:-1]
    out = trace.output_tokens
    done = np.ones(trace.n, dtype=np.int64)
    act = np.flatnonzero(out > 1)
    parts_r: list[np.ndarray] = []
    parts_d: list[np.ndarray] = []
    while act.size:
        d = done[act]
        pos = base[act] + d - 1
        e = np.minimum(np.minimum(acc[pos], k_flat[pos]) + 1, out[act] - d)
        parts_r.append(act)
        parts_d.append(d)
        d = d + e
        done[act] = d
        act = act[d < out[act]]
    if not parts_r:
        z = np.zeros(0, dtype=np.int64)
        return Rows(z, z, z.astype(np.int8), z, z)
    req = np.concatenate(parts_r)
    dn = np.concatenate(parts_d)
    order = np.argsort(req, kind="stable")
    req, dn = req[order], dn[order]
    pos = base[req] + dn - 1
    k = k_flat[pos]
    e = np.minimum(np.minimum(acc[pos], k) + 1, out[req] - dn)
    return Rows(req, dn, method_flat[pos].astype(np.int8), k, e)


def static_plan(trace: Trace, method: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-request (method code, K) expanded to per-position arrays."""
    return (
        np.repeat(np.asarray(method, np.int8), trace.output_tokens),
        np.repeat(np.asarray(k, np.int64), trace.output_tokens),
    )


def start_steps(n_steps: np.ndarray, concurrency: int) -> np.ndarray:
    """Closed loop: each request starts in the first slot that frees, in trace order."""
    free = [(0, s) for s in range(concurrency)]
    start = np.empty(len(n_steps), dtype=np.int64)
    steps = n_steps.tolist()
    for r, ns in enumerate(steps):
        f, s = heapq.heappop(free)
        start[r] = f
        heapq.heappush(free, (f + ns, s))
    return start


def price(
    profile: Profile,
    engine: EngineModel,
    *,
    n_steps: int,
    g: np.ndarray,
    rows: Rows,
    kv_rows: np.ndarray,
    prefill_g: np.ndarray,
    prompt: np.ndarray,
) -> np.ndarray:
    """Seconds for each of ``n_steps`` steps from its decode rows (at steps ``g``) and prefills. Static
    plans and oracles are priced without the controller plugin's cost (a static arm is a plain vLLM;
    an oracle is a bound); a step the engine model makes wait pays vLLM's host time in series
    (``EngineModel.waits``, ``Profile.with_host``)."""
    features = step_features(
        engine,
        n_steps=n_steps,
        g=g,
        method=rows.method,
        k=rows.k,
        kv_rows=kv_rows,
        prefill_g=prefill_g,
        prompt=prompt,
    )
    gpu = profile.step_time(**features)
    waits = np.where(features["ngram_rows"] > 0, engine.waits(True), engine.waits(False))
    out: np.ndarray = profile.with_host(gpu, batch=np.zeros(n_steps), waits=waits, plugin=None)
    return out


def step_features(
    engine: EngineModel,
    *,
    n_steps: int,
    g: np.ndarray,
    method: np.ndarray,
    k: np.ndarray,
    kv_rows: np.ndarray,
    prefill_g: np.ndarray,
    prompt: np.ndarray,
) -> dict[str, np.ndarray]:
    """``Profile.step_time``'s keywords for each of ``n_steps`` steps from its decode rows (method code,
    K and KV tokens of each row, at steps ``g``) and its prefills (``prompt`` tokens at ``prefill_g``).
    The simulator prices with it and ``sim.fit`` fits recorded steps with it, so both read steps alike."""
    G = n_steps
    count = np.bincount(g, minlength=G) + np.bincount(prefill_g, minlength=G)
    kv = np.bincount(g, weights=kv_rows, minlength=G)
    batched = np.bincount(g, weights=k + 1, minlength=G) + np.bincount(prefill_g, weights=prompt, minlength=G)
    zeros = np.zeros(G)
    spec: dict[Method, np.ndarray] = {}
    maxk: dict[Method, np.ndarray] = {}
    for m in (Method.EAGLE3, Method.P_EAGLE, Method.NGRAM):
        sel = (method == METHOD_CODES[m]) & (k > 0)
        if not sel.any():
            spec[m], maxk[m] = zeros, zeros
            continue
        gs, ks = g[sel], k[sel]
        spec[m] = np.bincount(gs, weights=ks, minlength=G)
        mk = np.zeros(G, dtype=np.int64)
        np.maximum.at(mk, gs, ks)
        maxk[m] = mk.astype(np.float64)
    any_row = (count > 0).astype(np.float64)
    eagle_fwd = maxk[Method.EAGLE3]
    if Method.EAGLE3 in engine.always_runs:
        eagle_fwd = np.maximum(eagle_fwd, any_row)
    eagle_spec = spec[Method.EAGLE3]
    if engine.granularity is not Granularity.BATCH_STEP:
        # Per request, EAGLE-3 proposes for every decode row at the step's longest EAGLE-3 K (as the
        # stepping kernel prices it; on a K-table engine every row drafts that K anyway).
        eagle_spec = eagle_fwd * np.bincount(g, minlength=G)
    pe_pass = (maxk[Method.P_EAGLE] > 0).astype(np.float64)
    if Method.P_EAGLE in engine.always_runs:
        pe_pass = any_row
    return {
        "kv": kv,
        "batched": batched,
        "eagle_forwards": eagle_fwd,
        "eagle_spec": eagle_spec,
        "p_eagle_passes": pe_pass,
        "p_eagle_spec": spec[Method.P_EAGLE],
        "ngram_rows": maxk[Method.NGRAM],
    }


def schedule_closed(
    trace: Trace, rows: Rows, *, concurrency: int, profile: Profile, engine: EngineModel, label: str = ""
) -> RunResult:
    """Time a walked plan in a closed loop at fixed concurrency (continuous batching)."""
    n = trace.n
    n_dec = np.bincount(rows.req, minlength=n)
    n_steps = n_dec + 1  # the prefill step emits the first token
    start = start_steps(n_steps, concurrency)
    first_row = np.concatenate([[0], np.cumsum(n_dec)[:-1]])
    j = np.arange(rows.n) - np.repeat(first_row, n_dec) + 1
    g = start[rows.req] + j
    G = int((start + n_steps).max())
    kv_rows = (trace.prompt_tokens[rows.req] + rows.done).astype(np.float64)
    step = price(
        profile,
        engine,
        n_steps=G,
        g=g,
        rows=rows,
        kv_rows=kv_rows,
        prefill_g=start,
        prompt=trace.prompt_tokens.astype(np.float64),
    )
    end = np.cumsum(step)
    begin = end - step
    accepted = rows.emitted - 1
    emitted = np.bincount(g, weights=rows.emitted, minlength=G) + np.bincount(start, minlength=G)
    codes = arm_code(rows.method, rows.k)
    uniq, inv = np.unique(codes, return_inverse=True)
    if not len(uniq):  # no decode step at all (every request is one token long): prefills only
        arm = np.full(G, -1, dtype=np.int64)
    elif len(uniq) == 1:
        arm = np.where(np.bincount(g, minlength=G) > 0, uniq[0], -1)
    else:
        counts = np.zeros((G, len(uniq)), dtype=np.int32)
        np.add.at(counts, (g, inv), 1)
        arm = np.where(counts.sum(axis=1) > 0, uniq[counts.argmax(axis=1)], -1)
    return RunResult(
        label=label,
        engine=engine.name,
        concurrency=concurrency,
        open_loop=False,
        submit_s=begin[start],
        first_token_s=end[start],
        finish_s=end[start + n_dec],
        output_tokens=trace.output_tokens.copy(),
        steps=G,
        request_steps=rows.n,
        drafted=int(rows.k.sum()),
        accepted=int(accepted.sum()),
        switches=0,
        timeline=Timeline(
            end,
            emitted,
            np.bincount(g, weights=rows.k, minlength=G),
            np.bincount(g, weights=accepted, minlength=G),
            arm,
        ),
    )


def replay_static(
    trace: Trace,
    *,
    method: Method,
    k: int,
    concurrency: int,
    profile: Profile,
    engine: EngineModel,
    label: str = "",
) -> RunResult:
    """One static arm for every request, closed loop."""
    code = METHOD_CODES[method]
    mf, kf = static_plan(trace, np.full(trace.n, code), np.full(trace.n, 0 if method is Method.OFF else k))
    rows = walk(trace, mf, kf)
    return schedule_closed(trace, rows, concurrency=concurrency, profile=profile, engine=engine, label=label)
