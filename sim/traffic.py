"""Traffic generators: small registries of traffic classes and scenarios (Vidur-style), pure data.

A ``TrafficClass`` says how one kind of request accepts drafts; a ``Scenario`` mixes classes over
the trace, optionally with arrival times (open loop), and may degrade or perturb acceptance.
``generate`` turns a scenario into a ``Trace`` (spectrace v1 semantics) with a seeded generator.

Acceptance models (per output position t of a request):

* EAGLE-3 is a chain draft with conditional per-position acceptance ``[first, tail, tail, ...]``,
  calibrated to Llama-3.1-8B: chat uses vLLM's measured EAGLE-3 vector (unconditional 0.76, 0.54,
  0.39, 0.28, ... => conditional ~0.76 then ~0.72, from the ``_DYNAMIC_STATS`` profile of vLLM's
  Dynamic-SD prototype); the other classes scale the expected accepted length by the EAGLE-3 paper's
  (arXiv 2503.01840) per-dataset tau ratios (HumanEval 6.74, GSM8K 6.23, CNN/DM 5.34 vs MT-bench 6.13,
  Table 1, T = 0).
* P-EAGLE keeps EAGLE-3's first position and raises deeper positions by ``p_eagle_gain`` (its
  acceptance grows faster with K: P-EAGLE blog, K = 3 -> 7 gains +0.92 vs +0.38 on HumanEval).
* n-gram is bursty: copy spans (text repeated from the prompt or earlier output) start at rate
  ``ngram_span_rate`` per token and last ``ngram_span_mean`` tokens on average; inside a span a draft
  started at t accepts the rest of the span; outside, n-gram rarely accepts one token. EAGLE-3 also
  accepts better inside spans (``span_eagle_alpha``), so the methods are correlated as in real text.
* The n-gram proposer's signal (``Trace.ngram_proposal``): vLLM's matcher needs ``min_n`` copied tokens
  before it finds a copy, so a span here starts after them (its counts are what n-gram can accept once
  matched). It proposes ``max_k`` tokens at every position of a span, at the positions where the
  background accepts a token (a short true match), at a span's last position with probability
  ``NGRAM_END_MATCH`` (the copy diverges after it: the draft's first token is wrong) and elsewhere at
  rate ``NGRAM_FALSE_MATCH``. So no match means n-gram accepts 0 (always, as measured on real traces)
  and a match accepts >= 1 at 93-98 % of matched positions per class (measured on real traces: 91-99 %).
  The proposal is drawn from its own seeded stream: the acceptance counts are those of a trace
  generated without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from policies.arms import Method
from sim.trace import Trace

HORIZON = 16  # longest EAGLE / P-EAGLE acceptance sampled (beyond any K the engines use)
NGRAM_CAP = 64
#: vLLM's default prompt-lookup window, recorded in the trace's ``meta.ngram``.
NGRAM_MIN_N, NGRAM_MAX_N = 4, 5
#: Chance that the matcher still matches at a span's last position (a false match: it accepts 0).
NGRAM_END_MATCH = 0.4
#: Chance per position outside spans of a false match (an n-gram seen before, continued differently).
NGRAM_FALSE_MATCH = 0.005


@dataclass(frozen=True, slots=True)
class TrafficClass:
    name: str
    description: str
    eagle3_first: float
    eagle3_tail: float
    p_eagle_gain: float
    ngram_span_rate: float
    ngram_span_mean: float
    ngram_background: float
    prompt_median: int
    output_median: int
    span_eagle_alpha: float = 0.85
    output_max: int = 1024

    def eagle3_alphas(self, horizon: int = HORIZON) -> np.ndarray:
        a = np.full(horizon, self.eagle3_tail)
        a[0] = self.eagle3_first
        return a

    def p_eagle_alphas(self, horizon: int = HORIZON) -> np.ndarray:
        a = self.eagle3_alphas(horizon)
        a[1:] = np.minimum(0.97, a[1:] * self.p_eagle_gain)
        return a


CLASSES: Mapping[str, TrafficClass] = {
    c.name: c
    for c in (
        TrafficClass(
            "chat", "ShareGPT / MT-Bench style conversation", 0.75, 0.70, 1.05, 0.080, 7.0, 0.10, 200, 300
        ),
        TrafficClass(
            "code", "HumanEval style code completion", 0.79, 0.74, 1.08, 0.090, 10.0, 0.12, 150, 220
        ),
        TrafficClass("maths", "GSM8K style step-by-step maths", 0.76, 0.71, 1.05, 0.090, 7.0, 0.10, 100, 200),
        TrafficClass(
            "summarisation",
            "CNN/DailyMail style summaries of a long article",
            0.66,
            0.60,
            1.04,
            0.140,
            12.0,
            0.12,
            800,
            110,
        ),
        TrafficClass(
            "code-edit",
            "InstructCoder style edits of given code (n-gram friendly)",
            0.76,
            0.72,
            1.06,
            0.150,
            20.0,
            0.15,
            600,
            300,
        ),
    )
}


Mix = Callable[[np.ndarray], np.ndarray]  # position in the trace (0..1) -> class weights per request


def _const_mix(weights: Mapping[str, float]) -> Mix:
    w = np.array([weights.get(c, 0.0) for c in CLASSES], dtype=np.float64)

    def mix(x: np.ndarray) -> np.ndarray:
        return np.broadcast_to(w, (len(x), len(w)))

    return mix


def _drift_mix(stages: tuple[Mapping[str, float], ...]) -> Mix:
    """Weights move linearly from one stage to the next across the trace."""
    table = np.array([[s.get(c, 0.0) for c in CLASSES] for s in stages], dtype=np.float64)

    def mix(x: np.ndarray) -> np.ndarray:
        pos = np.clip(x, 0.0, 1.0) * (len(stages) - 1)
        lo = np.minimum(pos.astype(np.int64), len(stages) - 2)
        frac = (pos - lo)[:, None]
        w: np.ndarray = table[lo] * (1 - frac) + table[lo + 1] * frac
        return w

    return mix


@dataclass(frozen=True, slots=True)
class Arrivals:
    """Poisson arrivals whose rate moves linearly from ``start_rps`` to ``end_rps`` over the trace."""

    start_rps: float
    end_rps: float


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    mix: Mix = field(compare=False)
    n_requests: int = 600
    arrivals: Arrivals | None = None
    #: Multiplies EAGLE-3 / P-EAGLE conditional acceptance (a draft head one version behind: < 1).
    draft_quality: float = 1.0
    #: Spread of per-request acceptance (MoE routing noise raises it) and per-position jitter.
    request_sd: float = 0.04
    position_sd: float = 0.0


_EVEN = {"chat": 1.0, "code": 1.0, "maths": 1.0, "summarisation": 1.0, "code-edit": 1.0}

SCENARIOS: Mapping[str, Scenario] = {
    s.name: s
    for s in (
        *(Scenario(c, f"only {c} requests: {CLASSES[c].description}", _const_mix({c: 1.0})) for c in CLASSES),
        Scenario("mixed", "an even mix of all classes", _const_mix(_EVEN)),
        Scenario(
            "drift",
            "the class mix shifts from chat to code editing to maths over the trace",
            _drift_mix(
                ({"chat": 0.8, "summarisation": 0.2}, {"code-edit": 0.8, "code": 0.2}, {"maths": 1.0})
            ),
            n_requests=900,
        ),
        Scenario(
            "load-ramp",
            "open loop: an even mix arriving at a rate ramping from 2 to 60 requests/s",
            _const_mix(_EVEN),
            n_requests=900,
            arrivals=Arrivals(2.0, 60.0),
        ),
        Scenario(
            "stale-draft",
            "an even mix with the draft head one version behind (acceptance x0.85)",
            _const_mix(_EVEN),
            draft_quality=0.85,
        ),
        Scenario(
            "moe-noise",
            "an even mix on an MoE target whose routing noise widens acceptance variance",
            _const_mix(_EVEN),
            request_sd=0.15,
            position_sd=0.10,
        ),
    )
}


def _lengths(rng: np.random.Generator, median: int, sigma: float, n: int, hi: int) -> np.ndarray:
    x: np.ndarray = np.clip(np.rint(median * np.exp(rng.normal(0.0, sigma, n))), 1, hi)
    return x.astype(np.int64)


def _markov_flags(first: np.ndarray, tail: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per-token predictability as a two-state chain with per-token probabilities.

    A draft started after token t accepts the run of predictable tokens from t + 1. A replayed step
    lands right after its bonus token, which ends a run (the first unpredictable token) unless K
    capped the draft; so the chain enters the predictable state with probability ``first`` after an
    unpredictable token and stays in it with probability ``tail``: in replay the first draft
    position is accepted at rate ``first`` and each deeper one at ``tail``, as the chain-draft
    vectors measured in vLLM. Counts at neighbouring positions stay consistent (acc[t] = acc[t+1] + 1
    when token t + 1 is predictable), as in a recorded greedy trace.
    """
    enter = first
    u = rng.random(len(first)).tolist()
    st, en = tail.tolist(), enter.tolist()
    flags = [False] * len(u)
    prev = False
    for i, x in enumerate(u):
        prev = x < (st[i] if prev else en[i])
        flags[i] = prev
    return np.array(flags, dtype=bool)


def run_lengths(flags: np.ndarray, n: int, cap: int) -> np.ndarray:
    """acc[t] for t < n: the number of consecutive predictable tokens starting at t + 1."""
    m = len(flags)
    idx = np.where(flags, m, np.arange(m))
    next_false = np.minimum.accumulate(idx[::-1])[::-1]
    return np.minimum(next_false[1 : n + 1] - np.arange(1, n + 1), cap).astype(np.int32)


def _ngram_spans(c: TrafficClass, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n-gram counts for one request of ``n`` positions, and a mask of positions inside copy spans."""
    counts = (rng.random(n) < c.ngram_background).astype(np.int32)
    inside = np.zeros(n, dtype=bool)
    t = 0
    while t < n:
        gap = int(rng.geometric(c.ngram_span_rate)) - 1 if c.ngram_span_rate > 0 else n
        t += gap
        if t >= n:
            break
        length = min(n - t, 1 + int(rng.geometric(1.0 / max(c.ngram_span_mean, 1.0))))
        counts[t : t + length] = np.minimum(np.arange(length - 1, -1, -1), NGRAM_CAP)
        inside[t : t + length] = True
        t += length
    return counts, inside


def ngram_proposals(
    counts: np.ndarray, inside: np.ndarray, offsets: np.ndarray, max_k: int, rng: np.random.Generator
) -> np.ndarray:
    """The n-gram proposer's draft length per position (see the module docstring), flat like counts."""
    # A span's last position: the next is outside it, or in the next request.
    last = inside & np.concatenate([~inside[1:], [True]])
    last[offsets[1:-1] - 1] = inside[offsets[1:-1] - 1]
    u = rng.random(len(counts))
    match = (counts > 0) | (last & (u < NGRAM_END_MATCH)) | (~inside & (u < NGRAM_FALSE_MATCH))
    return np.where(match, max_k, 0).astype(np.int32)


@dataclass(frozen=True, slots=True)
class Latent:
    """What the generator knew and a trace does not say: the odds behind each draw.

    Per request r, token i of its output (0-based; the arrays run ``HORIZON + 1`` past the end):
    ``enter[m][r][i]`` is the chance that token i is predictable for a chain draft of method m after
    an unpredictable token, ``stay[m][r][i]`` after a predictable one. n-gram: ``inside`` marks the
    positions in a copy span (there its count is the rest of the span, exactly), flat like ``Trace.acc``;
    outside, it accepts one token with chance ``ngram_background[r]``.
    """

    enter: Mapping[Method, tuple[np.ndarray, ...]]
    stay: Mapping[Method, tuple[np.ndarray, ...]]
    inside: np.ndarray
    ngram_background: np.ndarray


def generate(
    scenario: str | Scenario,
    *,
    n_requests: int | None = None,
    seed: int = 0,
    max_k: int = 8,
    methods: tuple[Method, ...] = (Method.EAGLE3, Method.P_EAGLE, Method.NGRAM),
) -> Trace:
    """A synthetic trace for a scenario (deterministic for a given seed)."""
    return generate_with_latent(scenario, n_requests=n_requests, seed=seed, max_k=max_k, methods=methods)[0]


def generate_with_latent(
    scenario: str | Scenario,
    *,
    n_requests: int | None = None,
    seed: int = 0,
    max_k: int = 8,
    methods: tuple[Method, ...] = (Method.EAGLE3, Method.P_EAGLE, Method.NGRAM),
) -> tuple[Trace, Latent]:
    """``generate``'s trace (the same for the same arguments) and the odds it was drawn from."""
    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    n = sc.n_requests if n_requests is None else n_requests
    if n < 1:
        raise ValueError(f"n_requests must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    names = list(CLASSES)
    weights = sc.mix(np.linspace(0.0, 1.0, n))
    cum = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)
    cls_idx = np.minimum((rng.random(n)[:, None] > cum).sum(axis=1), len(names) - 1)
    prompt = np.empty(n, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for i, name in enumerate(names):
        rows = np.flatnonzero(cls_idx == i)
        c = CLASSES[name]
        prompt[rows] = _lengths(rng, c.prompt_median, 0.6, len(rows), 8192)
        out[rows] = _lengths(rng, c.output_median, 0.7, len(rows), c.output_max)
    acc: dict[Method, list[np.ndarray]] = {m: [] for m in methods}
    enter: dict[Method, list[np.ndarray]] = {m: [] for m in methods if m is not Method.NGRAM}
    stay: dict[Method, list[np.ndarray]] = {m: [] for m in methods if m is not Method.NGRAM}
    insides: list[np.ndarray] = []
    background = np.array([CLASSES[names[i]].ngram_background for i in cls_idx])
    difficulty = np.clip(rng.normal(1.0, sc.request_sd, n), 0.3, 1.25)
    for r in range(n):
        c = CLASSES[names[cls_idx[r]]]
        length = int(out[r])
        ng, inside = _ngram_spans(c, length, rng)
        insides.append(inside)
        firsts = {Method.EAGLE3: c.eagle3_first, Method.P_EAGLE: c.eagle3_first}
        tails = {Method.EAGLE3: c.eagle3_tail, Method.P_EAGLE: min(0.97, c.eagle3_tail * c.p_eagle_gain)}
        # Token flags cover the output and a horizon beyond it (a draft may run past the end).
        span = np.concatenate([inside, np.zeros(HORIZON + 1, dtype=bool)])
        jitter = np.ones(length + HORIZON + 1)
        if sc.position_sd > 0:
            chunks = (length + HORIZON) // 16 + 1
            jitter = np.repeat(np.clip(rng.normal(1.0, sc.position_sd, chunks), 0.2, 1.3), 16)[: len(jitter)]
        for m in methods:
            if m is Method.NGRAM:
                acc[m].append(ng)
                continue
            q = sc.draft_quality * difficulty[r] * jitter
            first = np.where(span, c.span_eagle_alpha * sc.draft_quality, firsts[m] * q)
            tail = np.where(span, c.span_eagle_alpha * sc.draft_quality, tails[m] * q)
            en, st = np.clip(first, 0.0, 0.98), np.clip(tail, 0.0, 0.98)
            enter[m].append(en)
            stay[m].append(st)
            flags = _markov_flags(en, st, rng)
            acc[m].append(run_lengths(flags, length, HORIZON))
    arrival = np.full(n, np.nan)
    if sc.arrivals is not None:
        # Thinning-free ramp: each gap drawn at the rate in force at that point of the trace.
        rate = np.linspace(sc.arrivals.start_rps, sc.arrivals.end_rps, n)
        arrival = np.cumsum(rng.exponential(1.0 / rate))
        arrival -= arrival[0]
    flat_inside = np.concatenate(insides) if insides else np.zeros(0, dtype=bool)
    offsets = np.concatenate([[0], np.cumsum(out)])
    ng_counts = (
        np.concatenate(acc[Method.NGRAM]) if Method.NGRAM in acc else np.where(flat_inside, 1, 0)
    ).astype(np.int32)
    proposal = ngram_proposals(ng_counts, flat_inside, offsets, max_k, np.random.default_rng([seed, 0x6E67]))
    trace = Trace(
        max_k=max_k,
        methods=tuple(methods),
        ids=tuple(f"r{i}" for i in range(n)),
        classes=tuple(names[i] for i in cls_idx),
        prompt_tokens=prompt,
        output_tokens=out,
        arrival_s=arrival,
        acc={m: np.concatenate(v).astype(np.int32) for m, v in acc.items()},
        meta={
            "generator": "sim.traffic",
            "scenario": sc.name,
            "seed": seed,
            "ngram": {"min_n": NGRAM_MIN_N, "max_n": NGRAM_MAX_N},
        },
        name=sc.name,
        ngram_proposal=proposal,
    )
    latent = Latent(
        enter={m: tuple(v) for m, v in enter.items()},
        stay={m: tuple(v) for m, v in stay.items()},
        inside=flat_inside,
        ngram_background=background,
    )
    return trace, latent


def expected_accepted(alphas: np.ndarray, k: int) -> float:
    """E[min(count, K)] for a chain draft: sum over j <= K of the product of the first j alphas."""
    return float(np.cumprod(np.asarray(alphas, dtype=np.float64)[:k]).sum())
