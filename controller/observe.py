"""Observe-only adapter for vLLM engines without the plugin: their Prometheus ``/metrics``.

Between two scrapes, vLLM's counters give the drafts verified, draft tokens, accepted tokens per
draft position (so the exact histogram of accepted counts per draft), engine iterations, and queue
time; gauges give running and waiting requests. ``observation_between`` turns that into one
``StepObservation`` the ControlLoop can learn from: one row per verified draft (downsampled), the
accepted histogram reproduced exactly, and a duration chosen so that the rows' goodput equals the
interval's real token rate. The loop can then recommend, but nothing applies its directives: vLLM's
K is fixed at start-up without the plugin.

What must hold: a scrape that cannot be vLLM's (not Prometheus text, a counter NaN, infinite,
negative, fractional or beyond 2^53, a draft position missing, a series twice, several models with none
chosen, a body over 8 MiB inflated or slower than 5 s, an encoding other than gzip, a redirect off
http(s)) is a failed scrape, retried, never an observation; an interval across a restart (a counter
that went back, or one created anew: its ``_created`` time changed), with a series back from a scrape
without it, or whose counters contradict each other (more accepted than drafted, ...) is skipped,
saying so; intervals are timed on a steady clock; the exposition is read and parsed off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from controller.errors import ConfigError
from controller.validation import (
    MAX_MODEL,
    MAX_QUEUE_LENGTH,
    MAX_QUEUE_WAIT_S,
)
from controller.wire.address import parse_address
from controller.wire.names import engine_id_problem, escape_text, has_control
from policies.arms import METHOD_CODES, METHODS_BY_CODE, OFF, Arm, Method
from policies.directive import Directive
from policies.engine import EngineInfo, Granularity
from policies.observation import StepObservation
from policies.physics import MAX_STEP_S, step_floor_s
from policies.text import error_text

log = logging.getLogger("speccontrol.observe")

MAX_ROWS = 512
#: The shortest interval ``controllerctl observe`` scrapes at (a shorter ``--interval`` is raised to it,
#: saying so): as with Prometheus's scrape interval, a faster scrape only loads the target (vLLM
#: renders every metric per scrape; at 1 ms the observer scraped back to back) and its intervals hold
#: too few drafts to learn from. ``ObserverSettings`` itself takes shorter ones, for tests that drive
#: a fake /metrics.
MIN_INTERVAL_S = 1.0
#: The largest batch the adapter reports (the observer's Hello declares it; vLLM's max_num_seqs is far
#: below it in practice).
MAX_OBSERVED_BATCH = 4096
#: Draft positions the adapter reads (vLLM's per-position counter has one per drafted position; K is at
#: most this, as in every spectrace and policy).
MAX_POSITIONS = 64
#: The samples the adapter reads: all of them counters or gauges, never negative.
_READ = frozenset(
    {
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:iteration_tokens_total_count",
        "vllm:request_queue_time_seconds_sum",
        "vllm:request_queue_time_seconds_count",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    }
)


@dataclass(frozen=True, slots=True)
class VllmCounters:
    """The counters and gauges the adapter reads, summed over a server's engines."""

    time_s: float
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()
    iterations: float = 0.0
    queue_time_sum: float = 0.0
    queue_time_count: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    #: Whether the scrape had vllm:spec_decode_num_drafts_total at all (its absence reads as 0 above).
    has_drafts: bool = True
    #: Each counter series on its own (name and labels), before the sums above: a restart of one of
    #: several engines behind one endpoint can leave every sum growing.
    series: Mapping[str, float] = field(default_factory=dict)
    #: When each counter series read was created (its ``_created`` sample, name and labels of the
    #: counter), where the exposition has one: a counter created anew is an engine that restarted, even
    #: one that counted past its old total before the next scrape.
    created: Mapping[str, float] = field(default_factory=dict)


_DRAFTS = "vllm:spec_decode_num_drafts_total"
#: The largest counter read: 2^53, to which a double (prometheus_client's value) holds every whole number.
MAX_COUNT = 2.0**53
#: The samples read that are not counts (seconds summed), so not whole numbers.
_FRACTIONAL = frozenset({"vllm:request_queue_time_seconds_sum"})
#: The gauges among ``_READ`` (they go down as well as up); every other sample read is a counter.
_GAUGES = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
#: The counters an observation's steps and acceptance come from, beside the drafts counter (the gauges
#: and the queue histogram may be absent: a wait averaged over a longer span is still a wait).
_NEEDED = ("vllm:spec_decode_num_draft_tokens_total", "vllm:iteration_tokens_total_count")
#: The ``_created`` sample of each counter read, by the counter's sample name (prometheus_client writes
#: ``X_created`` beside ``X_total``, and beside a histogram's ``X_count``).
_CREATED = {
    n.removesuffix("_total").removesuffix("_count") + "_created": n
    for n in _READ - _GAUGES
    if n.endswith(("_total", "_count"))
}


def parse_metrics(text: str, *, time_s: float, model: str | None = None) -> VllmCounters:
    """Read vLLM's exposition text; raises ValueError when it is not Prometheus text; when a sample
    the adapter reads is not a finite number >= 0 (a count: a whole number at most 2^53), names a draft
    position outside 0..63, lacks a draft position below another of its engine's, or appears twice with
    the same labels (a scrape that cannot be vLLM's: it is refused, as an unreadable one is, not turned
    into an observation); when the samples read carry several ``model_name`` labels and ``model``
    chooses none, or ``model`` matches none of them."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    #: The positions each engine's per-position counters hold, by their labels other than position.
    positions: dict[str, set[int]] = {}
    series: dict[str, float] = {}
    created: dict[str, float] = {}
    seen: set[str] = set()
    #: The model_name labels of the samples read, and of those left out for another model.
    models: set[str] = set()
    others: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as e:  # the parser raises bare ValueError/TypeError variants
        raise ValueError(f"not Prometheus text: {e}") from None
    for fam in families:
        for s in fam.samples:
            if model is not None and s.labels.get("model_name", model) != model:
                if s.name in _READ:
                    others.add(s.labels["model_name"])
                continue
            if s.name in _CREATED:
                # (only compared for change: a value that is not a number is no creation time)
                if math.isfinite(s.value):
                    created[_CREATED[s.name] + _labels(s.labels)] = s.value
                continue
            if s.name not in _READ:
                continue
            if "model_name" in s.labels:
                models.add(s.labels["model_name"])
            if not (math.isfinite(s.value) and s.value >= 0):
                raise ValueError(f"{s.name}: must be a finite number >= 0, got {s.value}")
            # Beyond 2^53 a double no longer holds every whole number: deltas came out 0 or 256 at 2^60,
            # and an interval's histogram was noise. No engine counts that far. (The gauges are not
            # differenced, and their bounds are the sidecar's queue limits; seconds summed are no count.)
            where = f"{s.name}{escape_text(_labels(s.labels))[:200]}"
            if s.name not in _GAUGES and s.name not in _FRACTIONAL and s.value > MAX_COUNT:
                raise ValueError(f"{where}: must be at most 2^53, got {s.value:g}")
            if s.name not in _FRACTIONAL and not float(s.value).is_integer():
                raise ValueError(f"{where}: must be a whole number (a count), got {s.value:g}")
            key = s.name + _labels(s.labels)
            # A series twice in one scrape is no exposition (Prometheus refuses the duplicate sample);
            # summed, it doubled what the interval counted.
            if key in seen:
                raise ValueError(f"{escape_text(key)[:200]}: the same series appears twice")
            seen.add(key)
            if s.name not in _GAUGES:
                series[key] = s.value
            if s.name == _PER_POS:
                label = s.labels.get("position", "0")
                if not (label.isascii() and label.isdigit() and int(label) < MAX_POSITIONS):
                    raise ValueError(f"{s.name}: position must be 0..{MAX_POSITIONS - 1}, got {label[:20]!r}")
                pos = int(label)
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
                engine = _labels({n: v for n, v in s.labels.items() if n != "position"})
                positions.setdefault(engine, set()).add(pos)
            else:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    if model is None and len(models) > 1:
        # Two vLLMs behind one proxy, or a federated /metrics: summed, their counters made one engine
        # that does not exist (two acceptance rates, two K, in one histogram).
        raise ValueError(
            f"model_name: {len(models)} models in one exposition ({_names(models)}): their counters are "
            "not one engine's; choose one (--model-name)"
        )
    if model is not None and not sums and not per_pos and others:
        # (a model name misspelt read as an exposition without counters, for good)
        raise ValueError(
            f"model_name: no sample of the counters read for '{escape_text(model)[:80]}' (there are "
            f"{_names(others)})"
        )
    if _DRAFTS in sums:
        # A scrape that has the drafts counter but lacks one this adapter derives steps or acceptance
        # from cannot be read as zeros: the next interval would carry the engine's whole lifetime.
        missing = [m for m in _NEEDED if m not in sums]
        missing += [] if per_pos or not sums[_DRAFTS] else [_PER_POS]
        if missing:
            raise ValueError(f"{', '.join(missing)}: missing beside {_DRAFTS}")
    for engine, held in positions.items():
        # vLLM keeps a counter for every position it drafts: one missing was read as 0, and every
        # draft that accepted past it was reported as stopping before it.
        gap = min(set(range(max(held) + 1)) - held, default=None)
        if gap is not None:
            raise ValueError(
                f"{_PER_POS}: position {gap} missing beside position {max(held)} ({escape_text(engine)[:200]})"
            )
    k = max(per_pos) + 1 if per_pos else 0
    return VllmCounters(
        time_s=time_s,
        drafts=sums.get(_DRAFTS, 0.0),
        draft_tokens=sums.get("vllm:spec_decode_num_draft_tokens_total", 0.0),
        accepted=sums.get("vllm:spec_decode_num_accepted_tokens_total", 0.0),
        per_position=tuple(per_pos.get(i, 0.0) for i in range(k)),
        iterations=sums.get("vllm:iteration_tokens_total_count", 0.0),
        queue_time_sum=sums.get("vllm:request_queue_time_seconds_sum", 0.0),
        queue_time_count=sums.get("vllm:request_queue_time_seconds_count", 0.0),
        running=sums.get("vllm:num_requests_running", 0.0),
        waiting=sums.get("vllm:num_requests_waiting", 0.0),
        has_drafts=_DRAFTS in sums,
        series=series,
        created=created,
    )


def _names(names: set[str]) -> str:
    """Label values for an error line: sorted, quoted, escaped, at most five."""
    shown = sorted(names)
    text = ", ".join(f"'{escape_text(n)[:80]}'" for n in shown[:5])
    return text + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")


def _labels(labels: Mapping[str, str]) -> str:
    """Labels as the exposition writes them (``{engine="0",model_name="m"}``), sorted and escaped (so two
    label sets never read alike): a series' key, and its name in an error line."""

    def quoted(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{n}="{quoted(v)}"' for n, v in sorted(labels.items())) + "}"


def _went_back(prev: VllmCounters, cur: VllmCounters) -> str | None:
    """The first counter that went backwards between the scrapes while the drafts counter grew (an
    engine restarted: every delta across it is wrong, not only a negative one), or None."""
    for name, before, after in (
        ("vllm:spec_decode_num_draft_tokens_total", prev.draft_tokens, cur.draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens_total", prev.accepted, cur.accepted),
        ("vllm:iteration_tokens_total_count", prev.iterations, cur.iterations),
        ("vllm:request_queue_time_seconds_sum", prev.queue_time_sum, cur.queue_time_sum),
        ("vllm:request_queue_time_seconds_count", prev.queue_time_count, cur.queue_time_count),
    ):
        if after < before:
            return name
    for i, before in enumerate(prev.per_position):
        if (cur.per_position[i] if i < len(cur.per_position) else 0.0) < before:
            return f'{_PER_POS}{{position="{i}"}}'
    for key, before in prev.series.items():
        # A series that vanished while the scrape kept its kind: its engine went away or restarted.
        if cur.series.get(key, 0.0) < before:
            return escape_text(key)[:200]
    return None


_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


def _contradiction(prev: VllmCounters, cur: VllmCounters, drafts: float) -> str | None:
    """What no engine counts in an interval of ``drafts`` drafts (> 0, no counter gone back), or None.
    vLLM adds each step's drafts, draft tokens, accepted tokens and accepted tokens per position at once,
    with the step's iteration (one ``record`` call, rendered on the same event loop), so in every
    interval: drafts were verified in a step at least; a draft has a token at least; a draft's accepted
    tokens are a prefix of it (position i + 1 is accepted only where i was, position 0 at most once per
    draft); the accepted total is its positions' sum and at most the tokens drafted. Capped
    (``np.minimum``) or ignored, such counters became reports of drafts accepting what was never
    drafted."""
    draft_tokens = cur.draft_tokens - prev.draft_tokens
    accepted = cur.accepted - prev.accepted
    if cur.iterations <= prev.iterations:  # (reported as steps of one request: a batch nobody measured)
        return f"vllm:iteration_tokens_total_count did not grow: {drafts:g} drafts verified in no engine step"
    if draft_tokens < drafts:
        return (
            f"{_DRAFT_TOKENS} grew by {draft_tokens:g}, less than the {drafts:g} drafts (each drafts a token)"
        )
    if accepted > draft_tokens:
        return f"{_ACCEPTED} grew by {accepted:g}, more than the {draft_tokens:g} tokens drafted"
    before = prev.per_position + (0.0,) * max(0, len(cur.per_position) - len(prev.per_position))
    grown = [c - b for c, b in zip(cur.per_position, before, strict=False)]
    bound, of = drafts, "the drafts"
    for i, g in enumerate(grown):
        if g > bound:
            return (
                f'{_PER_POS}{{position="{i}"}} grew by {g:g}, more than {of} ({bound:g}): a draft\'s '
                "accepted tokens are a prefix of it"
            )
        bound, of = g, f"position {i}"
    total = sum(grown)
    if total > draft_tokens:
        return f"{_PER_POS} grew by {total:g} in all, more than the {draft_tokens:g} tokens drafted"
    # (only where both scrapes have the total: an exposition without it reads it as 0)
    has_total = all(any(k.partition("{")[0] == _ACCEPTED for k in c.series) for c in (prev, cur))
    if has_total and total != accepted:
        return f"{_ACCEPTED} grew by {accepted:g}, its positions ({_PER_POS}) by {total:g}"
    return None


def _created_anew(prev: VllmCounters, cur: VllmCounters) -> str | None:
    """The first counter series created again between the scrapes, or None: an engine that restarted
    and counted past its old totals before the next scrape leaves every counter growing, and the
    interval's deltas would mix two lifetimes."""
    for key, before in prev.created.items():
        after = cur.created.get(key)
        if after is not None and after != before:
            return escape_text(key)[:200]
    return None


def observation_between(
    prev: VllmCounters,
    cur: VllmCounters,
    *,
    method: Method,
    max_rows: int = MAX_ROWS,
    max_k: int = MAX_POSITIONS,
) -> StepObservation | None:
    """One observation for the interval, or None when nothing was verified (or the drafts counter
    went back: vLLM restarted).
    ``max_k``: the engine's num_speculative_tokens; the rows' K never exceeds it, whatever the
    counters' ratio of draft tokens to drafts says. Raises ValueError, saying what, for another counter
    that went backwards while the drafts grew (one of the engines behind the endpoint restarted: the
    interval's deltas mean nothing) and for an interval no engine produces (less than one draft,
    steps shorter than a microsecond or than 50 ns per request of their batch, or longer than an
    hour, a batch beyond ``MAX_OBSERVED_BATCH``, a queue beyond the sidecar's limits): the sidecar
    would refuse its reports, or learn from numbers no engine made."""
    drafts = cur.drafts - prev.drafts
    dt = cur.time_s - prev.time_s
    if drafts < 0 and cur.has_drafts:  # vLLM restarted: the interval is no data, and that is said
        raise ValueError("the drafts counter went backwards (vLLM restarted?)")
    if drafts == 0 or dt <= 0 or not cur.has_drafts:  # idle (or a scrape without the counter)
        return None
    back = _went_back(prev, cur)
    if back is not None:
        raise ValueError(f"{back} went backwards (vLLM restarted?)")
    for key in sorted(prev.series.keys() - cur.series.keys()):
        # (one that held more than 0 went back, above) At 0 in the last scrape, absent now (a proxy's
        # partial scrape): what it counted in the interval is not in the sums, and the interval was
        # reported as the other engines' alone.
        raise ValueError(f"{escape_text(key)[:200]} is gone from this scrape (a partial scrape?)")
    for key, after in cur.series.items():
        # Absent from the last scrape (a proxy's partial scrape), back now: what it holds was counted
        # before this interval too (engine 1's whole lifetime was read as 5 s of drafts). (A baseline
        # without series is no scrape: counters at zero, built by hand.)
        if after > 0 and prev.series and key not in prev.series:
            raise ValueError(
                f"{escape_text(key)[:200]} appeared with {after:g} since the last scrape (counted before "
                "this interval too)"
            )
    anew = _created_anew(prev, cur)
    if anew is not None:
        raise ValueError(f"{anew} started over (its _created time changed: vLLM restarted)")
    deltas = np.array(
        [
            c - (prev.per_position[i] if i < len(prev.per_position) else 0.0)
            for i, c in enumerate(cur.per_position)
        ]
    )
    deltas = np.maximum(deltas, 0.0)
    # K: the mean drafted length, or more if some draft had a later position accepted (K varied).
    seen = int(np.flatnonzero(deltas)[-1]) + 1 if deltas.any() else 0
    # (>= 0: no counter went back; it may be inf, over a denormal number of drafts, which min() caps)
    mean_k = (cur.draft_tokens - prev.draft_tokens) / drafts
    k = min(max(1, seen, round(min(mean_k, max_k))), max_k)
    pos = np.zeros(k)
    pos[: min(k, len(deltas))] = deltas[:k]
    # Drafts with exactly j accepted: reached position j, not position j + 1.
    reached = np.concatenate([[drafts], np.minimum.accumulate(np.minimum(pos, drafts))])
    hist = np.maximum(reached[:-1] - reached[1:], 0.0)
    hist = np.append(hist, reached[-1])  # all k accepted
    n = int(min(max_rows, drafts))
    counts = _apportion(hist, n)
    accepted = np.repeat(np.arange(k + 1), counts).astype(np.int32)
    iterations = cur.iterations - prev.iterations
    per_step = drafts / iterations if iterations > 0 else cur.running
    # min(): an iteration count that grew by a denormal makes per_step inf, which round() refuses
    batch = max(1, round(min(per_step, MAX_OBSERVED_BATCH + 1)))
    qn = cur.queue_time_count - prev.queue_time_count
    wait = (cur.queue_time_sum - prev.queue_time_sum) / qn if qn > 0 else 0.0
    row_s = dt / drafts
    step_s = row_s * min(batch, n)
    # n < 1: a counter grew by less than one draft (a denormal one made row_s inf, and inf * 0 a NaN
    # that passed the comparison: an observation of no rows was sent). The shortest step sent must
    # pass the sidecar's floor for a step of its batch_size (policies.physics).
    shortest_s = row_s * min((hi - lo for lo, hi in step_bounds(n, batch)), default=0)
    if n < 1 or shortest_s < step_floor_s(batch):
        raise ValueError(f"no engine verifies {drafts:g} drafts in {dt:g} s")
    if step_s > MAX_STEP_S:
        raise ValueError(f"{drafts:g} drafts in {dt:g} s: steps of more than {MAX_STEP_S:g} s")
    if batch > MAX_OBSERVED_BATCH:
        raise ValueError(
            f"a batch of {per_step:g} requests ({drafts:g} drafts over {iterations:g} iterations)"
        )
    if wait > MAX_QUEUE_WAIT_S or cur.waiting > MAX_QUEUE_LENGTH:
        raise ValueError(f"a queue of {cur.waiting:g} requests waiting {wait:g} s on average")
    contradiction = _contradiction(prev, cur, drafts)
    if contradiction is not None:
        raise ValueError(f"impossible interval: {contradiction}")
    code = METHOD_CODES[method]
    return StepObservation(
        time_s=cur.time_s,
        # The n rows stand for all `drafts` request-steps of the interval.
        duration_s=dt * n / drafts,
        batch_size=batch,
        queue_length=round(cur.waiting),
        queue_wait_s=max(wait, 0.0),
        traffic_class=("default",) * n,
        method=np.full(n, code, dtype=np.int8),
        k=np.full(n, k, dtype=np.int32),
        drafted=np.full(n, k, dtype=np.int32),
        accepted=accepted,
    )


def _apportion(weights: np.ndarray, n: int) -> np.ndarray:
    """Integer counts summing to n in proportion to weights (largest remainder)."""
    total = float(weights.sum())
    if total <= 0 or n <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    exact = weights * (n / total)
    base = np.floor(exact).astype(np.int64)
    short = n - int(base.sum())
    if short > 0:
        order = np.argsort(-(exact - base), kind="stable")[:short]
        base[order] += 1
    return base


@dataclass(frozen=True, slots=True)
class ObserverSettings:
    """Where to read and where to report; what the engine was started with; how hard to retry."""

    metrics_url: str
    engine_target: str
    engine_id: str
    model: str = "vllm"
    method: Method = Method.EAGLE3
    #: The engine's num_speculative_tokens: the arms the policy may recommend are method:1..max_k and off.
    max_k: int = 4
    interval_s: float = 5.0
    #: Only samples with this model_name label (None: all).
    model_name: str | None = None
    #: Consecutive failures (of the scrape, or of reaching the sidecar) tolerated before giving up.
    retries: int = 10
    #: The first retry waits this long; each further one twice as long, at most ``backoff_max_s``.
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        _check_url(self.metrics_url)
        try:
            parse_address(self.engine_target, field="engine_target", dial=True)
        except ConfigError as e:
            raise ValueError(f"engine_target: {e.message}") from None
        problem = engine_id_problem(self.engine_id)
        if problem is not None:
            raise ValueError(f"engine_id: {problem}")
        # The sidecar refuses such a Hello: found here it is a usage error, not a runtime one.
        if has_control(self.model) or len(self.model) > MAX_MODEL:
            raise ValueError(
                f"model: must be at most {MAX_MODEL} characters without control characters, got "
                f"'{escape_text(self.model)[:80]}'"
            )
        if self.model_name is not None and (
            not self.model_name or has_control(self.model_name) or len(self.model_name) > MAX_MODEL
        ):
            raise ValueError(
                f"model_name: must be 1..{MAX_MODEL} characters without control characters, got "
                f"'{escape_text(self.model_name)[:80]}'"
            )
        if not 1 <= self.max_k <= 64:
            raise ValueError(f"max_k: must be 1..64, got {self.max_k}")
        if not (math.isfinite(self.interval_s) and 0 < self.interval_s <= 3600):
            raise ValueError(f"interval_s: must be in (0, 3600] seconds, got {self.interval_s}")
        if not 0 <= self.retries <= 1_000_000:
            raise ValueError(f"retries: must be 0..1000000, got {self.retries}")
        if not (0 < self.backoff_s <= self.backoff_max_s <= 3600):
            raise ValueError("backoff: need 0 < backoff_s <= backoff_max_s <= 3600")

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based)."""
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** min(failures - 1, 32)))


class ObserverError(RuntimeError):
    """The observer gave up: /metrics or the sidecar stayed unreachable, or the sidecar refused it."""


def _check_url(url: str) -> None:
    """``metrics_url``: http(s)://host[:port]/path, printable; raises ValueError saying what is wrong."""
    import urllib.parse

    shown = escape_text(url)[:120]
    if (
        not url.lower().startswith(("http://", "https://"))
        or has_control(url)
        or any(c.isspace() for c in url)
    ):
        raise ValueError(f"metrics_url: expected http://host:port/metrics, got '{shown}'")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        raise ValueError(f"metrics_url: {e}, in '{shown}'") from None
    if not parts.hostname or port == 0:
        raise ValueError(
            f"metrics_url: expected http://host:port/metrics (a host, a port 1..65535), got '{shown}'"
        )


#: How long one scrape may take, all of it.
_SCRAPE_S = 5.0
#: The longest /metrics body read; a longer one is an error, not a cut one parsed.
MAX_BODY_BYTES = 8 * 1024 * 1024


def _http_redirects_only() -> type:
    """urllib's redirect handler, following a redirect only to http(s): urllib's own follows ftp://
    too, and a /metrics answering 302 to ftp://host:port/ made the observer log in there (anonymous FTP,
    at a host of the server's choosing) and wait for its banner."""
    import urllib.error
    import urllib.request

    class HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
        def redirect_request(  # type: ignore[no-untyped-def]
            self, req, fp, code, msg, headers, newurl
        ) -> urllib.request.Request | None:
            if not newurl.lower().startswith(("http://", "https://")):
                raise urllib.error.HTTPError(
                    newurl,
                    code,
                    f"a redirect to '{escape_text(newurl)[:120]}' is not followed (http or https only)",
                    headers,
                    fp,
                )
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    return HttpRedirectsOnly


def scrape(url: str, *, timeout_s: float = _SCRAPE_S, max_bytes: int = MAX_BODY_BYTES) -> str:
    """The body at ``url``, gunzipped where the server gzipped it (a proxy may, unasked). Raises OSError
    (TimeoutError when the whole response takes longer than ``timeout_s``, however slowly it trickles
    in), ``http.client.HTTPException`` or ValueError (a body over ``max_bytes``, decompressed: a gzip
    bomb is cut there; a gzip body that is broken or cut short; another Content-Encoding)."""
    import urllib.request
    import zlib

    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0

    def keep(data: bytes) -> None:
        nonlocal size
        size += len(data)
        if size > max_bytes:
            raise ValueError(f"the response is over {max_bytes} bytes")
        chunks.append(data)

    with urllib.request.build_opener(_http_redirects_only()).open(url, timeout=timeout_s) as resp:
        encoding = (resp.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding not in ("identity", "gzip", "x-gzip"):
            # (urllib asks for none: Accept-Encoding: identity; such a body parsed as text was noise)
            raise ValueError(f"Content-Encoding '{escape_text(encoding)[:40]}': not read (none or gzip)")
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding != "identity" else None
        while chunk := resp.read1(65536):
            if inflate is None:
                keep(chunk)
            else:
                try:
                    # At most one byte past the limit out of each chunk: a 100 kB bomb of 100 MB is never
                    # inflated whole (what is left of the chunk past the limit is not needed).
                    keep(inflate.decompress(chunk, max_bytes + 1 - size))
                except zlib.error as e:
                    raise ValueError(f"gzip body: {e}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no whole response within {timeout_s:g} s")
        if getattr(resp, "length", None):  # what Content-Length promised and never came
            raise http.client.IncompleteRead(b"", resp.length)
        if inflate is not None and not inflate.eof:
            raise ValueError("gzip body: cut short (no gzip end)")
    return b"".join(chunks).decode("utf-8", "replace")


def _text(body: str) -> str:
    return body


_T = TypeVar("_T")

#: Scrapes still hanging (a server that trickles its headers in: urllib's timeout is per read) beyond
#: which the observer starts no more and counts the attempt as failed.
_MAX_HANGING = 4


class _Scraper(Generic[_T]):
    """Each scrape on a daemon thread of its own, awaited at most ``timeout_s``: a server that trickles
    its response in can hold a thread (urllib's timeout is per read), never the observer, the
    process's exit (asyncio's executor joins its threads at exit) or a pool later scrapes need.
    ``read`` turns the body into what the scrape returns, on that thread too: parsing an 8 MiB
    exposition takes seconds, which on the event loop stalled the observer's stream and its Ctrl-C."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        read: Callable[[str], _T] = _text,  # type: ignore[assignment]
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.read = read
        self._hanging = 0

    async def __call__(self) -> _T:
        import threading

        if self._hanging >= _MAX_HANGING:
            raise TimeoutError(f"{self._hanging} earlier scrapes still hang")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_T] = loop.create_future()
        # Its error is read here as well: when the observer stopped waiting (its deadline passed, or
        # it ended on another error) the error came later to nobody, and asyncio printed it with a
        # traceback as "Future exception was never retrieved".
        done.add_done_callback(lambda f: f.cancelled() or f.exception())

        def deliver(value: _T | BaseException) -> None:
            self._hanging -= 1
            if done.done():
                return
            if isinstance(value, BaseException):
                done.set_exception(value)
            else:
                done.set_result(value)

        def work() -> None:
            value: _T | BaseException
            try:
                value = self.read(scrape(self.url, timeout_s=self.timeout_s))
            except BaseException as e:  # (handed to the awaiting side, which sorts it)
                value = e
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
                loop.call_soon_threadsafe(deliver, value)

        self._hanging += 1
        threading.Thread(target=work, name="speccontrol-scrape", daemon=True).start()
        try:
            async with asyncio.timeout(self.timeout_s):  # (not wait_for: see pause in run_observer)
                return await asyncio.shield(done)
        except TimeoutError:
            raise TimeoutError(f"no whole response within {self.timeout_s:g} s") from None


def _reason(e: BaseException) -> str:
    """One line for a scrape error (urllib nests the interesting part in ``reason``). An HTTP error's
    status goes first: its reason is the server's own text, which alone may not say it failed."""
    import urllib.error

    text = error_text(e)
    line = text.splitlines()[0] if text.strip() else type(e).__name__
    if isinstance(e, urllib.error.HTTPError):
        line = f"HTTP {e.code}: {line}"
    return escape_text(line)[:300]


_RETRYABLE_RPC = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")


async def run_observer(
    settings: ObserverSettings,
    *,
    on_directive: Callable[[Directive], None] | None = None,
    on_status: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> int:
    """Scrape every interval and stream what changed to the sidecar as an observe-only engine.

    Returns the number of observations sent. The directives that come back are recommendations;
    ``on_directive`` hears only those that follow data (the first directive after attaching is the
    policy's prior, not a recommendation). ``on_status`` hears, one line each, when /metrics or the
    sidecar cannot be reached (and the retry), when they are back, and when there is no data yet.
    A scrape or a connection that keeps failing ``settings.retries`` times in a row raises
    ObserverError; so does a sidecar that refuses the observer. ``clock`` times the intervals: a steady
    clock (the wall clock, stepped by NTP or by hand, made an interval last an hour, or vanish);
    ``wall`` stamps the reports (``StepReport.time_s``, the wall time, as the plugin stamps its steps).
    """
    import grpc

    from controller.v1 import controller_pb2 as pb
    from controller.v1 import controller_pb2_grpc as rpc
    from controller.wire.convert import directive_from_pb, hello_from_engine_info

    s = settings
    say = on_status or (lambda m: log.warning("%s", m))
    arms = (*(Arm(s.method, k) for k in range(1, s.max_k + 1)), OFF)
    info = EngineInfo(s.engine_id, s.model, s.max_k, arms, Granularity.BATCH_STEP, MAX_OBSERVED_BATCH)
    hello = hello_from_engine_info(info, engine_version="observe-only: vllm /metrics")
    hello.observe_only = True
    hello.instance_id = uuid.uuid4().hex
    stop = stop or asyncio.Event()
    sent = 0
    seq = 0
    prev: VllmCounters | None = None
    scrape_failures = 0
    connect_failures = 0
    said_no_data = False
    said_gone = False  # said that the drafts counter vanished after data had flowed
    said_positions = 0  # the draft positions /metrics counts, when said to differ from max_k

    async def pause(seconds: float) -> None:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that arrives as its
        # timeout fires, and a producer that lived on past its session's end blocked on a full outbox
        # for good (the observer hung instead of retrying).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await stop.wait()

    async def produce(outbox: asyncio.Queue[pb.EngineMessage | None]) -> None:
        nonlocal sent, seq, prev, scrape_failures, said_no_data, said_gone, said_positions
        scraper = _Scraper(
            s.metrics_url,
            timeout_s=_SCRAPE_S,
            read=lambda text: parse_metrics(text, time_s=clock(), model=s.model_name),
        )
        while not stop.is_set():
            try:
                cur = await scraper()
            except (OSError, ValueError, http.client.HTTPException) as e:
                scrape_failures += 1
                if scrape_failures > s.retries:
                    raise ObserverError(
                        f"cannot read {s.metrics_url} ({_reason(e)}); gave up after "
                        f"{scrape_failures} attempts in a row"
                    ) from None
                delay = s.backoff(scrape_failures)
                say(
                    f"cannot read {s.metrics_url}: {_reason(e)}; retry {scrape_failures} of {s.retries} "
                    f"in {delay:g} s"
                )
                await pause(delay)
                continue
            if scrape_failures:
                say(f"reading {s.metrics_url} again")
                scrape_failures = 0
            try:
                obs = (
                    observation_between(prev, cur, method=s.method, max_k=s.max_k)
                    if prev is not None
                    else None
                )
            except ValueError as e:  # an interval no engine produces: its reports would be refused
                say(f"skipped the interval from {s.metrics_url}: {e}")
                obs = None
            # A scrape without the drafts counter (vLLM not serving speculation yet, or a scrape that
            # lost every vllm sample) is no baseline: read as zeros, the next interval would carry the
            # engine's whole lifetime.
            prev = cur if cur.has_drafts else prev
            # vLLM keeps one per-position counter per position it drafts (num_speculative_tokens): a
            # max_k other than that is a mistake that is silent otherwise (rows cut at max_k, or arms
            # recommended that vLLM cannot draft).
            positions = len(cur.per_position)
            if positions and positions != s.max_k and positions != said_positions:
                said_positions = positions
                say(
                    f"{s.metrics_url} counts {positions} draft positions ({_PER_POS}), but max_k (--max-k, "
                    f"the engine's num_speculative_tokens) is {s.max_k}: recommendations assume {s.max_k}"
                )
            if obs is not None:
                seq += 1
                steps = _reports(obs, time_s=wall())
                await outbox.put(pb.EngineMessage(reports=pb.StepReportBatch(sequence=seq, steps=steps)))
                sent += 1
                said_no_data = False
            elif sent == 0 and not said_no_data and cur.drafts == 0:
                said_no_data = True
                say(
                    f"no speculative decoding counters in {s.metrics_url} yet (vllm:spec_decode_num_drafts_total "
                    "is absent or 0: is vLLM serving with --speculative-config?); no recommendation without data"
                )
            elif sent and not cur.has_drafts and not said_gone:  # (it went silent without a word)
                said_gone = True
                say(f"{_DRAFTS} is gone from {s.metrics_url}; no data until it is back")
            if cur.has_drafts and said_gone:
                said_gone = False
                say(f"{_DRAFTS} is back in {s.metrics_url}")
            await pause(s.interval_s)

    async def session() -> bool:
        """One Attach stream until stop (True) or a stream error (raised). False: it ended early."""
        outbox: asyncio.Queue[pb.EngineMessage | None] = asyncio.Queue(maxsize=64)
        await outbox.put(pb.EngineMessage(hello=hello))

        async def messages() -> AsyncIterator[pb.EngineMessage]:
            while True:
                m = await outbox.get()
                if m is None:
                    return
                yield m

        async with grpc.aio.insecure_channel(s.engine_target) as channel:
            stub = rpc.EngineServiceStub(channel)  # type: ignore[no-untyped-call]

            async def consume() -> None:
                nonlocal connect_failures
                async for d in stub.Attach(messages()):
                    if connect_failures:
                        say(f"attached to the sidecar at {s.engine_target} again")
                    connect_failures = 0
                    if on_directive is not None and sent > 0:
                        on_directive(directive_from_pb(d))

            producer = asyncio.create_task(produce(outbox))
            consumer = asyncio.create_task(consume())
            stopper = asyncio.create_task(stop.wait())
            try:
                done, _ = await asyncio.wait(
                    {producer, consumer, stopper}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for t in (producer, consumer, stopper):
                    t.cancel()
                await asyncio.gather(producer, consumer, stopper, return_exceptions=True)
            for t in (producer, consumer):
                if t in done and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            return stop.is_set()

    while not stop.is_set():
        try:
            if await session():
                break
            detail = "the sidecar closed the stream"
        except grpc.aio.AioRpcError as e:
            detail = (e.details() or e.code().name).splitlines()[0]
            if e.code().name not in _RETRYABLE_RPC:
                raise ObserverError(
                    f"the sidecar at {s.engine_target} refused the observer: {e.code().name.lower()}: {detail}"
                ) from None
        connect_failures += 1
        if connect_failures > s.retries:
            raise ObserverError(
                f"cannot reach the sidecar at {s.engine_target} ({detail}); gave up after "
                f"{connect_failures} attempts in a row"
            )
        delay = s.backoff(connect_failures)
        say(
            f"sidecar at {s.engine_target} unreachable: {detail}; retry {connect_failures} of {s.retries} "
            f"in {delay:g} s"
        )
        await pause(delay)
    return sent


def step_bounds(n: int, batch: int) -> list[tuple[int, int]]:
    """``n`` rows as engine steps of at most ``batch`` rows, as even as can be (sizes differ by one at
    most): a last step of one row would be given a duration too short for the sidecar to take."""
    steps = -(-n // max(1, batch))
    if steps <= 0:
        return []
    size, extra = divmod(n, steps)
    bounds, lo = [], 0
    for i in range(steps):
        hi = lo + size + (1 if i < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _reports(obs: StepObservation, *, time_s: float | None = None) -> list[Any]:
    """The interval's rows as engine steps of at most ``batch_size`` rows each (what a real engine
    reports), stamped ``time_s`` (default: the observation's)."""
    from controller.v1 import controller_pb2 as pb
    from controller.wire.codec import request_steps

    n, b = obs.n, max(1, obs.batch_size)
    out = []
    for lo, hi in step_bounds(n, b):
        out.append(
            pb.StepReport(
                time_s=obs.time_s if time_s is None else time_s,
                duration_s=obs.duration_s * (hi - lo) / n,
                batch_size=max(b, hi - lo),
                queue_length=obs.queue_length,
                queue_wait_s=obs.queue_wait_s,
                scheduled_k=int(obs.k[lo]),
                requests=request_steps(
                    request_ids=[f"m{i}" for i in range(lo, hi)],
                    classes=obs.traffic_class[lo:hi],
                    methods=[METHODS_BY_CODE[int(c)].value for c in obs.method[lo:hi]],
                    ks=obs.k[lo:hi].tolist(),
                    drafted=obs.drafted[lo:hi].tolist(),
                    accepted=obs.accepted[lo:hi].tolist(),
                ),
            )
        )
    return out
