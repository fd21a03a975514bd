"""Hindsight oracles: what the best fixed or clairvoyant choices would have reached on a trace.

* ``best static``: every single arm, each on the stock engine that hosts it; the best throughput.
* ``per class`` / ``per phase``: one arm per traffic class (or per quarter of the trace), chosen by
  coordinate ascent over the composite engine's arms (the engine that can apply per-request arms),
  trying at most ``MAX_ORACLE_CLASSES`` classes (those of the most output tokens).
  In a closed loop at fixed concurrency the batch bucket is fixed, so per class is per (class, bucket).
* ``per step``: knowing every future acceptance, each request picks at every position the method
  and K that minimise its share of engine time to the end (dynamic programming over positions, the
  step cost priced per row at the run's full batch, min(concurrency, requests), and mean context),
  replayed on an engine that has every drafter and runs only the ones used. Those prices are exact
  only while the batch is full: where a closed-loop run drains (its last requests running alone, each
  paying a whole step's fixed cost) a policy that plays those steps better can pass it by a little
  (0.24 % on two requests of 25 and 26 tokens, tests/sim/test_physics_edges.py), so it is an upper
  estimate, a bound up to the drain.

The reported oracle is the best of all of them, so it is never below any static configuration;
policies are reported as a ratio to each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from policies.arms import METHOD_CODES, OFF, Arm, Method
from policies.engine import Granularity
from sim.costmodel import Profile
from sim.engines import ENGINES, EngineModel, engine_for_arm
from sim.run import RunResult
from sim.trace import Trace
from sim.traffic import Latent
from sim.vectorised import Rows, replay_static, schedule_closed, static_plan, walk

#: Groups (traffic classes) whose arm the per-group ascent tries, those of the most output tokens; the
#: rest keep the arm it starts from. Each trial replays the whole trace, so trying every class made the
#: work classes x trace: 600 one-request classes took 28 s where 2 took 1.6 s, 20,000 took hours.
MAX_ORACLE_CLASSES = 32

ORACLE_ENGINE = EngineModel(
    "oracle",
    "every drafter, per-request method and K, drafters run only when used",
    Granularity.REQUEST_METHOD,
    (Method.EAGLE3, Method.P_EAGLE, Method.NGRAM),
)


def static_arms(trace: Trace) -> list[Arm]:
    """Every arm a stock engine can play on this trace's methods."""
    out: list[Arm] = []
    for m in trace.methods:
        out.extend(a for a in engine_for_arm(Arm(m, 1)).arms(trace.max_k) if a.method is m)
    return [*out, OFF]


@dataclass(slots=True)
class Oracles:
    concurrency: int
    static: dict[str, RunResult] = field(default_factory=dict)
    per_class: RunResult | None = None
    per_class_arms: dict[str, str] = field(default_factory=dict)
    per_phase: RunResult | None = None
    per_phase_arms: dict[str, str] = field(default_factory=dict)
    per_step: RunResult | None = None

    @property
    def best_static(self) -> tuple[str, RunResult]:
        label = max(self.static, key=lambda k: self.static[k].throughput)
        return label, self.static[label]

    def throughputs(self) -> dict[str, float]:
        out = {"best_static": self.best_static[1].throughput}
        for name in ("per_class", "per_phase", "per_step"):
            r = getattr(self, name)
            if r is not None:
                out[name] = r.throughput
        return out

    @property
    def throughput(self) -> float:
        return max(self.throughputs().values())


def _thr(r: RunResult | None) -> float:
    return r.throughput if r is not None else 0.0


def run_static_arms(trace: Trace, profile: Profile, concurrency: int) -> dict[str, RunResult]:
    return {
        str(a): replay_static(
            trace,
            method=a.method,
            k=a.k,
            concurrency=concurrency,
            profile=profile,
            engine=engine_for_arm(a),
            label=f"static {a}",
        )
        for a in static_arms(trace)
    }


class _ArmRows:
    """Walked rows of every candidate arm, combined per assignment without walking again."""

    def __init__(self, trace: Trace, arms: list[Arm]) -> None:
        self.arms = arms
        self.rows: list[Rows] = []
        for a in arms:
            mf, kf = static_plan(trace, np.full(trace.n, METHOD_CODES[a.method]), np.full(trace.n, a.k))
            self.rows.append(walk(trace, mf, kf))

    def combine(self, arm_of_request: np.ndarray) -> Rows:
        parts = []
        for i, rw in enumerate(self.rows):
            sel = arm_of_request[rw.req] == i
            if sel.any():
                parts.append((rw.req[sel], rw.done[sel], rw.method[sel], rw.k[sel], rw.emitted[sel]))
        if not parts:  # no decode rows at all (every request is one token long)
            return self.rows[0]
        req = np.concatenate([p[0] for p in parts])
        order = np.argsort(req, kind="stable")
        cols = [np.concatenate([p[j] for p in parts])[order] for j in range(5)]
        return Rows(*cols)


def best_per_group(
    trace: Trace,
    profile: Profile,
    concurrency: int,
    group: np.ndarray,
    names: list[str],
    *,
    engine: EngineModel,
    candidates: list[Arm],
    start: Arm,
    label: str,
) -> tuple[RunResult, dict[str, str]]:
    """One arm per group by coordinate ascent (two passes), timed on ``engine``: over the
    ``MAX_ORACLE_CLASSES`` groups of the most output tokens, in group order; any others keep ``start``."""
    pool = _ArmRows(trace, candidates)
    choice = np.full(len(names), candidates.index(start))
    tried: list[int] = list(range(len(names)))
    if len(names) > MAX_ORACLE_CLASSES:
        tokens = np.bincount(group, weights=trace.output_tokens, minlength=len(names))
        tried = sorted(np.argsort(-tokens, kind="stable")[:MAX_ORACLE_CLASSES].tolist())

    def run(ch: np.ndarray) -> RunResult:
        return schedule_closed(
            trace,
            pool.combine(ch[group]),
            concurrency=concurrency,
            profile=profile,
            engine=engine,
            label=label,
        )

    best = run(choice)
    for _ in range(2):
        improved = False
        for gi in tried:
            for ai in range(len(candidates)):
                if ai == choice[gi]:
                    continue
                trial = choice.copy()
                trial[gi] = ai
                r = run(trial)
                if r.throughput > best.throughput:
                    best, choice, improved = r, trial, True
        if not improved:
            break
    return best, {names[g]: str(candidates[choice[g]]) for g in range(len(names))}


def _used(trace: Trace, methods: tuple[Method, ...] | None) -> tuple[Method, ...]:
    if methods is not None:
        unknown = [m.value for m in methods if m not in trace.acc]
        if unknown:
            raise ValueError(f"per-step oracle: the trace has no acceptance for {', '.join(unknown)}")
    return tuple(m for m in trace.methods if methods is None or m in methods)


def _step_options(
    trace: Trace, profile: Profile, concurrency: int, used: tuple[Method, ...], engine: EngineModel
) -> list[tuple[int, int, float]]:
    """(method code, K, a row's share of engine time) for every choice, priced at the run's concurrency.

    On an engine that runs the EAGLE-3 head's first forward every step (the composite drafter), a
    choice that drafts no EAGLE-3 still pays for that forward.
    """
    B = float(min(concurrency, trace.n))  # (the batch a run of n requests can have)
    ctx = float(np.mean(trace.prompt_tokens + trace.output_tokens / 2.0))
    kv_total = B * ctx
    tg = profile.target
    fixed = tg.const_s + profile.overhead_s + tg.kv_s_per_token * kv_total
    if profile.moe is not None:
        fixed += float(profile.moe(np.array([B]))[0])
    share = fixed / B
    if Method.EAGLE3 in engine.always_runs:
        share += float(profile.draft_forward_time(np.array([kv_total]), np.array([B]))[0]) / B
    options: list[tuple[int, int, float]] = [(METHOD_CODES[Method.OFF], 0, share + tg.batched_s_per_token)]
    for m in used:
        for k in range(1, trace.max_k + 1):
            verify_row = share + tg.batched_s_per_token * (k + 1)
            fwd = float(profile.draft_forward_time(np.array([kv_total]), np.array([B * k]))[0])
            if m is Method.EAGLE3:
                # Its first forward is already in ``share`` where the engine always runs it.
                draft = (k - (1 if Method.EAGLE3 in engine.always_runs else 0)) * fwd / B
            elif m is Method.P_EAGLE:
                draft = profile.p_eagle_pass_forwards * fwd / B + profile.p_eagle_slot_s * k
            else:
                draft = profile.ngram_verify_fraction * verify_row
            options.append((METHOD_CODES[m], k, verify_row + draft))
    return options


def _replay_plan(
    trace: Trace,
    profile: Profile,
    concurrency: int,
    options: list[tuple[int, int, float]],
    choice: np.ndarray,
    label: str,
    engine: EngineModel,
) -> RunResult:
    """Replay a per-(request, tokens done) choice of option on the realised trace."""
    out = trace.output_tokens
    rows_of = np.repeat(np.arange(trace.n), out)
    cols_of = np.arange(trace.total_output_tokens) - np.repeat(trace.offsets[:-1], out)
    codes = np.array([o[0] for o in options], dtype=np.int8)
    ks = np.array([o[1] for o in options], dtype=np.int64)
    # Position t of request r is decided in state done = t + 1 (``choice`` ragged: ``_state_base``).
    pick = choice[_state_base(out)[rows_of] + cols_of + 1]
    rows = walk(trace, codes[pick], ks[pick])
    return schedule_closed(trace, rows, concurrency=concurrency, profile=profile, engine=engine, label=label)


def _per_request(trace: Trace, flat: np.ndarray, width: int) -> np.ndarray:
    """A flat per-position array as (request, position), zero-padded to ``width``."""
    out = trace.output_tokens
    rows_of = np.repeat(np.arange(trace.n), out)
    cols_of = np.arange(trace.total_output_tokens) - np.repeat(trace.offsets[:-1], out)
    mat = np.zeros((trace.n, width), dtype=flat.dtype)
    mat[rows_of, cols_of] = flat
    return mat


#: ``future(code, k, act, s, remaining, V, vb)``: see ``_plan_backwards``.
Future = Callable[[int, int, np.ndarray, int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def _state_base(out: np.ndarray) -> np.ndarray:
    """Where request r's states s = 0..out[r] + 1 start in the ragged value and choice arrays: each
    request holds its own length, not the longest's (a dense requests x longest matrix was 32 GB for
    10^4 requests beside one of 4M tokens, and the oracle ran out of memory)."""
    return np.concatenate([[0], np.cumsum(out + 2)[:-1]]).astype(np.int64)


def _plan_backwards(out: np.ndarray, options: list[tuple[int, int, float]], future: Future) -> np.ndarray:
    """Per (request, tokens done), the option that minimises the time to finish, by dynamic programming.

    ``future(code, k, act, s, remaining, V, vb)``: for the requests ``act`` at ``s`` tokens done, the
    value (time still to spend, from ``V``) of where drafting ``k`` with ``code`` leads them; request
    ``act[i]``'s state ``s`` is ``V[vb[i] + s]`` (``_state_base``). Returns the choice, ragged alike.
    """
    base = _state_base(out)
    size = int((out + 2).sum())
    V = np.zeros(size)
    choice = np.zeros(size, dtype=np.int64)
    # Requests longest first: the ones still running at s are a prefix (no scan of every request per s).
    order = np.argsort(-out, kind="stable")
    longest = out[order]
    for s in range(int(out.max()) - 1, 0, -1):
        act = order[: int(np.count_nonzero(longest > s))]
        if not act.size:
            continue
        vb = base[act]
        remaining = out[act] - s
        best = np.full(act.size, np.inf)
        arg = np.zeros(act.size, dtype=np.int64)
        for oi, (code, k, cost) in enumerate(options):
            v = cost + future(code, k, act, s, remaining, V, vb)
            better = v < best
            best = np.where(better, v, best)
            arg = np.where(better, oi, arg)
        V[vb + s] = best
        choice[vb + s] = arg
    return choice


def per_step_oracle(
    trace: Trace,
    profile: Profile,
    concurrency: int,
    *,
    methods: tuple[Method, ...] | None = None,
    engine: EngineModel = ORACLE_ENGINE,
) -> RunResult:
    """The clairvoyant per-position (method, K) plan, by dynamic programming per request.

    ``methods`` limits the drafters it may use (default: every one the trace scored) and ``engine``
    prices the steps (default: one that runs a drafter only when a request uses it), so a policy on
    an engine that hosts only some drafters is compared with an oracle on that engine. Memory is
    linear in the trace's output tokens (flat arrays, as the trace holds them).
    """
    used = _used(trace, methods)
    options = _step_options(trace, profile, concurrency, used, engine)
    acc = {METHOD_CODES[m]: trace.acc[m].astype(np.int64) for m in used}
    start = trace.offsets[:-1]

    def future(
        code: int, k: int, act: np.ndarray, s: int, remaining: np.ndarray, V: np.ndarray, vb: np.ndarray
    ) -> np.ndarray:
        a = acc[code][start[act] + (s - 1)] if k > 0 else np.zeros(act.size, dtype=np.int64)
        out: np.ndarray = V[vb + s + np.minimum(np.minimum(a, k) + 1, remaining)]
        return out

    choice = _plan_backwards(trace.output_tokens, options, future)
    return _replay_plan(trace, profile, concurrency, options, choice, "oracle per step", engine)


def latent_oracle(
    trace: Trace,
    latent: Latent,
    profile: Profile,
    concurrency: int,
    *,
    methods: tuple[Method, ...] | None = None,
    engine: EngineModel = ORACLE_ENGINE,
    eagle_k: int | None = None,
    span_seen_after: int = 0,
) -> RunResult:
    """The best plan for a policy that knows the generator's odds but not its draws.

    It knows every request's copy spans (so n-gram's count inside one, exactly) and the chance that
    each token is predictable for EAGLE-3 (class, request and position quality), but not which
    tokens were: it minimises the *expected* engine time to finish each request (dynamic programming
    over positions, the same step prices as the clairvoyant oracle), then plays that plan on the
    realised trace. Any causal policy knows less, so on a generated trace this estimates the ceiling
    of what one can reach (estimates: a step's first draft position is taken at the "after an
    unpredictable token" odds, as the generator's replay semantics say).
    """
    used = _used(trace, methods)
    n, L = trace.n, int(trace.output_tokens.max())
    options = _step_options(trace, profile, concurrency, used, engine)
    if eagle_k is not None:
        # One EAGLE-3 K for every step: the plan prices a row's passes as its own, while a batched
        # engine runs the longest K of the step for all rows; with one K the two agree.
        options = [o for o in options if o[0] != METHOD_CODES[Method.EAGLE3] or o[1] == eagle_k]
    max_k = trace.max_k
    inside = _per_request(trace, latent.inside, L)
    if span_seen_after:
        # A span is known only once it has run ``span_seen_after`` positions (what a drafter's own
        # scored step reveals); before that its positions look like any other.
        seen = inside.copy()
        for d in range(1, span_seen_after + 1):
            seen[:, d:] &= inside[:, :-d]
            seen[:, :d] = False
        inside = seen
    ngram = _per_request(trace, trace.acc[Method.NGRAM].astype(np.int64), L) if Method.NGRAM in used else None
    chains: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for m in used:
        if m is Method.NGRAM:
            continue
        width = L + max_k + 2
        en = np.zeros((n, width))
        st = np.zeros((n, width))
        for r in range(n):
            e_r, s_r = latent.enter[m][r], latent.stay[m][r]
            en[r, : min(len(e_r), width)] = e_r[:width]
            st[r, : min(len(s_r), width)] = s_r[:width]
        chains[METHOD_CODES[m]] = (en, st)
    bg = latent.ngram_background
    memo: dict[int, list[np.ndarray]] = {}

    def future(
        code: int, k: int, act: np.ndarray, s: int, remaining: np.ndarray, V: np.ndarray, vb: np.ndarray
    ) -> np.ndarray:
        if s not in memo:  # where accepting j = 0..max_k leads, once per s
            memo.clear()
            memo[s] = [V[vb + s + np.minimum(j + 1, remaining)] for j in range(max_k + 1)]
        after = memo[s]
        t = s - 1  # the draft's position: it accepts predictable tokens from t + 1 on
        if k == 0:
            return after[0]
        if code in chains:
            en, st = chains[code]
            # P(at least j accepted): the first token at the entry odds, the rest at the stay odds.
            surv = np.cumprod(np.column_stack([en[act, t + 1], st[act, t + 2 : t + k + 1]]), axis=1)
            p_ge = np.column_stack([np.ones(act.size), surv])  # j = 0..k
            p_eq = p_ge.copy()
            p_eq[:, :-1] -= p_ge[:, 1:]
            ev: np.ndarray = sum(p_eq[:, j] * after[j] for j in range(k + 1))
            return ev
        assert ngram is not None
        exact = np.minimum(ngram[act, t], k)
        in_span = V[vb + s + np.minimum(exact + 1, remaining)]
        outside = (1.0 - bg[act]) * after[0] + bg[act] * after[1]
        out: np.ndarray = np.where(inside[act, t], in_span, outside)
        return out

    choice = _plan_backwards(trace.output_tokens, options, future)
    return _replay_plan(trace, profile, concurrency, options, choice, "oracle, latent odds", engine)


def compute_oracles(
    trace: Trace,
    profile: Profile,
    concurrency: int,
    *,
    groups: bool = True,
    per_step: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Oracles:
    o = Oracles(concurrency=concurrency, static=run_static_arms(trace, profile, concurrency))
    if groups:
        comp = ENGINES["composite"]
        cand = [a for a in comp.arms(trace.max_k) if a.method in trace.acc or a.method is Method.OFF]
        singles = {a: o.static.get(str(a)) for a in cand}
        ranked = sorted(cand, key=lambda a: -_thr(singles[a]))[:6]
        cls_idx, names = trace.class_index()
        if progress:
            progress("oracle per class")
        o.per_class, o.per_class_arms = best_per_group(
            trace,
            profile,
            concurrency,
            cls_idx,
            names,
            engine=comp,
            candidates=ranked,
            start=ranked[0],
            label="oracle per class",
        )
        phases = np.minimum((np.arange(trace.n) * 4) // max(trace.n, 1), 3)
        pnames = [f"phase {i + 1}/4" for i in range(4)]
        if progress:
            progress("oracle per phase")
        o.per_phase, o.per_phase_arms = best_per_group(
            trace,
            profile,
            concurrency,
            phases,
            pnames,
            engine=comp,
            candidates=ranked,
            start=ranked[0],
            label="oracle per phase",
        )
    if per_step:
        if progress:
            progress("oracle per step")
        o.per_step = per_step_oracle(trace, profile, concurrency)
    return o
