"""Import traces: from vLLM's per-request speculative-decoding metrics, or from greedy token ids.

``import_token_ids`` computes n-gram's counts and proposals exactly (see ``ngram_columns``); the rest of
this docstring is about ``import_vllm_metrics``.

vLLM (``--per-request-spec-decode-metrics detailed``) returns, when a request finishes,
``metrics.speculative_decoding.per_step_accepted`` / ``per_step_drafted``: one entry per verify step.
That is what one configuration saw, not every method at every position, so the imported trace is
an approximation of ``spectrace`` semantics, stated in its header ``meta``:

* At a step's start position t the count is exact when fewer tokens were accepted than drafted, and
  censored at the drafted K otherwise (recorded as K: replays with a larger K see no more).
* Positions inside an accepted run get the rest of the run (t + j accepts a - j), as the same
  drafter would have proposed the same accepted tokens.
* Steps without drafts (K = 0 phases) are not reported by vLLM, so positions after such a phase are
  misaligned; import traces recorded at a fixed K > 0. Responses whose steps account for clearly fewer
  tokens than they produced are counted in one warning; a file in which no response has a drafted
  step is refused (its trace would say "nothing accepted" everywhere).

Both imports take ``arrival_s`` on every line or on none (as the trace holds it): a file with it on
some lines only drops it from every request, said in one warning naming the first line without it.
Warnings go to ``warn`` (stderr when None), one line each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from policies.arms import Method
from policies.params import shown
from policies.prompt_lookup import MAX_NGRAM
from policies.text import one_line
from sim.trace import (
    DEFAULT_LIMITS,
    MAX_ARRIVAL_S,
    MAX_COUNT,
    MAX_K_LIMIT,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    TRACE_METHODS,
    Trace,
    TraceError,
    TraceLimits,
    _bad_int_list,
    _int_in,
    _is_num,
    file_name_text,
    input_path,
    load_json_line,
    read_json_lines,
)


def _spec_metrics(obj: dict[str, Any]) -> Any:
    m = obj.get("metrics")
    if not isinstance(m, dict):
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            m = choices[0].get("metrics")
    return m.get("speculative_decoding") if isinstance(m, dict) else None


def counts_from_steps(output_tokens: int, accepted: list[int], drafted: list[int]) -> np.ndarray:
    """Per-position counts for one request from its per-step accepted / drafted lists."""
    acc = np.zeros(output_tokens, dtype=np.int32)
    done = 1
    for a, d in zip(accepted, drafted, strict=True):
        pos = done - 1
        if pos >= output_tokens - 1:
            break
        a = min(a, d)
        run = np.arange(a, -1, -1)[: output_tokens - pos]
        acc[pos : pos + len(run)] = run
        done += a + 1
    return acc


def _check_decodes(output_tokens: list[int], source: str) -> None:
    """Refuse what the trace reader would refuse of the import's output: requests that each made one
    token (prefill's), so that no replay has a decode step to compare."""
    if all(n == 1 for n in output_tokens):
        raise TraceError(
            "every request has 1 output token (prefill's): a replay needs one with >= 2", source=source
        )


def _request_names(obj: dict[str, Any], lineno: int, fail: Any) -> tuple[str, str]:
    """A line's request id (``line<N>`` when absent) and traffic class (``traffic_class`` or ``class``;
    ``default`` when absent or null), as the trace format takes them: an id is a non-empty string (an
    integer is written as one), a class a non-empty string. Anything else raises ``fail``'s TraceError,
    where the import used to write it as text (a null class became the class ``None``); so do both
    keys with different values (``traffic_class`` won: a line's ``class`` was dropped unread). A null
    key is an absent one: the other one's class is taken (a null ``traffic_class`` made it ``default``)."""
    rid: Any = obj.get("id", f"line{lineno}")
    if isinstance(rid, int) and not isinstance(rid, bool):
        rid = str(rid)
    if not isinstance(rid, str) or not rid:
        raise fail("id", f"must be a non-empty string, got {shown(rid)}")
    key = "traffic_class" if obj.get("traffic_class") is not None else "class"
    if key == "traffic_class" and obj.get("class") is not None and obj["class"] != obj[key]:
        raise fail(
            "class", f"{shown(obj['class'])}, but traffic_class is {shown(obj[key])}: give one of them"
        )
    cls: Any = obj.get(key)
    if cls is None:
        cls = "default"
    if not isinstance(cls, str) or not cls:
        raise fail(key, f"must be a non-empty string, got {shown(cls)}")
    return rid, cls


def _to_stderr(message: str) -> None:
    print(one_line(message), file=sys.stderr)


def _arrivals(arrival: list[float], lines: list[int], src: str, warn: Callable[[str], None]) -> np.ndarray:
    """The requests' arrivals, all or none as a trace holds them: some lines without one drop every
    request's, said in one warning (they were dropped silently, and the trace then cannot be replayed
    open loop)."""
    arrivals = np.array(arrival)
    missing = np.isnan(arrivals)
    if missing.any():
        if not missing.all():
            first = lines[int(np.argmax(missing))]
            has = lines[int(np.argmin(missing))]
            warn(
                f"{src}:{first}: arrival_s: missing, but line {has} has one: arrival times dropped from "
                f"every request (a trace has them on all or none)"
            )
        arrivals[:] = np.nan
    return arrivals


def _arrival(obj: dict[str, Any], fail: Any) -> float:
    """A line's ``arrival_s`` (NaN when absent: a trace has arrivals on every request or on none).
    One out of range is refused: it used to drop every request's arrival silently."""
    arr: Any = obj.get("arrival_s")
    if arr is None:
        return float("nan")
    if not _is_num(arr) or not 0 <= arr <= MAX_ARRIVAL_S:
        raise fail("arrival_s", f"must be a number 0..{MAX_ARRIVAL_S:g}, got {shown(arr)}")
    return float(arr)


def _response_token_ids(obj: dict[str, Any]) -> tuple[Any, Any]:
    """(prompt token ids, output token ids) of a response asked with ``return_token_ids`` (None where
    absent): the completions API puts both on the choice, the chat API the prompt's on the response."""
    choices = obj.get("choices")
    c = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    return c.get("prompt_token_ids", obj.get("prompt_token_ids")), c.get("token_ids")


def _checked_response(obj: Any, fail: Any) -> tuple[int, int, list[int], list[int]]:
    """(prompt tokens, output tokens, per-step accepted, per-step drafted) of one vLLM response, checked
    as a trace takes them (``fail(field, message)`` makes the error raised; ``_checked_token_ids`` checks
    the token ids). ``trace record`` checks each answer with both as it comes (``response_problem``):
    one the import would refuse failed the whole recording after every request."""
    if not isinstance(obj, dict):
        raise fail("", "expected a JSON object (a vLLM response)")
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        raise fail("usage", "missing: the response needs usage.prompt_tokens and completion_tokens")
    n_out: Any = usage.get("completion_tokens")
    n_in: Any = usage.get("prompt_tokens", 0)
    if not _int_in(n_out, 1, MAX_OUTPUT_TOKENS):
        raise fail(
            "usage.completion_tokens", f"expected an integer 1..{MAX_OUTPUT_TOKENS}, got {shown(n_out)}"
        )
    if not _int_in(n_in, 0, MAX_PROMPT_TOKENS):
        raise fail("usage.prompt_tokens", f"expected an integer 0..{MAX_PROMPT_TOKENS}, got {shown(n_in)}")
    sd = _spec_metrics(obj)
    if not isinstance(sd, dict):
        raise fail(
            "metrics.speculative_decoding",
            "missing (start vLLM with --per-request-spec-decode-metrics detailed)",
        )
    pa, pd = sd.get("per_step_accepted"), sd.get("per_step_drafted")
    ok = (
        isinstance(pa, list)
        and isinstance(pd, list)
        and len(pa) == len(pd)
        and _bad_int_list(pa + pd, 0, MAX_K_LIMIT) is None
    )
    if not ok:
        raise fail(
            "metrics.speculative_decoding.per_step_accepted",
            f"per_step_accepted and per_step_drafted must be equal-length lists of integers "
            f"0..{MAX_K_LIMIT} (use --per-request-spec-decode-metrics detailed)",
        )
    assert isinstance(pa, list) and isinstance(pd, list)
    over = next((i for i, (x, d) in enumerate(zip(pa, pd, strict=True)) if x > d), None)
    if over is not None:
        raise fail(
            f"metrics.speculative_decoding.per_step_accepted[{over}]",
            f"{pa[over]} accepted of {pd[over]} drafted: a step accepts at most what it drafted",
        )
    before_last = 1 + sum(pa[:-1]) + len(pa[:-1])  # prefill's token, then a + 1 per step
    if pa and before_last >= n_out:
        raise fail(
            "metrics.speculative_decoding.per_step_accepted",
            f"{len(pa)} steps emit more than usage.completion_tokens ({n_out}): {before_last} tokens "
            "before the last step",
        )
    return n_in, n_out, pa, pd


def response_problem(obj: Any) -> str | None:
    """Why the answer ``obj`` cannot be a response of an imported trace (``field: message``; None: it
    can), the import's own checks (``trace record`` fails such a request, naming it)."""

    def fail(fld: str, msg: str) -> ValueError:
        return ValueError(f"{fld}: {msg}" if fld else msg)

    try:
        _, n_out, _, _ = _checked_response(obj, fail)
        pids, oids = _response_token_ids(obj)
        if pids is not None and oids is not None:
            _checked_token_ids(pids, oids, n_out, fail)
    except ValueError as e:
        return str(e)
    return None


def _checked_token_ids(pids: Any, oids: Any, n_out: int, fail: Any) -> tuple[np.ndarray, np.ndarray]:
    """A response's (prompt, output) token ids, checked: token ids, as many output ones as its usage says."""
    pid = _token_ids(pids, "choices[0].prompt_token_ids", fail, min_len=0)
    oid = _token_ids(oids, "choices[0].token_ids", fail, min_len=1)
    if len(oid) != n_out:
        raise fail("choices[0].token_ids", f"{len(oid)} token ids, but usage.completion_tokens is {n_out}")
    return pid, oid


def import_vllm_metrics(
    path: str | Path,
    *,
    method: Method = Method.EAGLE3,
    limits: TraceLimits = DEFAULT_LIMITS,
    ngram: tuple[int, int] | None = None,
    greedy: bool = False,
    warn: Callable[[str], None] | None = None,
) -> Trace:
    """A trace from JSON Lines of vLLM responses (completions or chat) carrying detailed spec metrics.

    Each line: a response object with ``usage.prompt_tokens``, ``usage.completion_tokens`` and
    ``metrics.speculative_decoding.per_step_accepted/per_step_drafted``; optional ``id``,
    ``traffic_class`` (or ``class``) and ``arrival_s`` fields are carried over.

    ``ngram`` = (min_n, max_n): where every response also carries its token ids (``return_token_ids``),
    the trace gets ``ngram_proposal`` (and ``meta.ngram``) computed from them with the matcher the
    plugin runs (see ``ngram_columns``), the signal the engine reports per step; a trace recorded with
    n-gram drafting then takes its ``acc.ngram`` from the token ids too (exact, where the engine's counts
    are censored at the recorded K and could disagree with the proposal inside an accepted run).
    ``greedy``: the responses were decoded greedily (``trace record``), so n-gram's counts computed
    from the token ids are exact whatever method drafted: a trace recorded with another method gets
    ``acc.ngram`` as well (what the composite drafter's replay needs).
    """
    if method not in TRACE_METHODS:
        raise TraceError(f"cannot import method {method.value!r}", source=str(path))
    say = warn or _to_stderr
    p = input_path(path)
    ids: list[str] = []
    seen: set[str] = set()  # ids' membership: a list made the import quadratic in its responses
    classes: list[str] = []
    prompt: list[int] = []
    out: list[int] = []
    arrival: list[float] = []
    acc: list[np.ndarray] = []
    # n-gram's columns per response, (acc.ngram, proposal capped at NGRAM_HORIZON), computed as each
    # line is read: keeping every response's token ids to the end held 16 bytes a token (prompts
    # included) until then. None once a response came without token ids (then no proposal at all).
    ngram_cols: list[tuple[np.ndarray, np.ndarray]] | None = [] if ngram is not None else None
    lines: list[int] = []
    no_ids: list[int] = []  # lines of responses without token ids (with ``ngram``)
    drafted = False  # a step with drafts on some line
    uncovered: list[tuple[int, int]] = []  # (line, tokens) of responses their steps fall short of
    max_k = 1
    src = str(p)
    for lineno, text in read_json_lines(p, limits):

        def fail(fld: str, msg: str, lineno: int = lineno) -> TraceError:
            return TraceError(msg, source=src, line=lineno, field=fld)

        obj = load_json_line(text, source=src, line=lineno, limits=limits)
        n_in, n_out, pa, pd = _checked_response(obj, fail)
        # Tokens the steps account for: prefill's, then a + 1 per step. Short of the output by more than
        # one step's reach, K = 0 steps (not reported) made the rest: counts 0 there, later ones misaligned.
        short = n_out - (1 + sum(pa) + len(pa))
        if short > max(pd, default=0) + 1:
            uncovered.append((lineno, short))
        drafted = drafted or any(d > 0 for d in pd)
        rid, cls = _request_names(obj, lineno, fail)
        while rid in seen:  # a repeated id gets its line number, as often as it takes to be unique
            rid = f"{rid}-{lineno}"
        seen.add(rid)
        ids.append(rid)
        classes.append(cls)
        prompt.append(n_in)
        out.append(n_out)
        arrival.append(_arrival(obj, fail))
        lines.append(lineno)
        acc.append(counts_from_steps(n_out, pa, pd))
        max_k = max([max_k, *pd])
        if ngram is not None:
            pids, oids = _response_token_ids(obj)
            if pids is None or oids is None:
                ngram_cols = None  # (its lines are still checked, as they were)
                no_ids.append(lineno)
            else:
                pid, oid = _checked_token_ids(pids, oids, n_out, fail)
                if ngram_cols is not None:
                    # max_k is known only at the end: the proposal is capped at the horizon here (a
                    # draft is never longer) and at max_k below, min(len, max_k) as the matcher caps it.
                    ngram_cols.append(
                        ngram_columns(pid, oid, min_n=ngram[0], max_n=ngram[1], max_k=NGRAM_HORIZON)
                    )
    if not ids:
        raise TraceError("no responses found", source=str(p))
    _check_decodes(out, src)
    if not drafted:
        raise TraceError(
            "no response carries speculative steps (per_step_drafted empty or 0 on every line): the "
            "engine did not speculate; record at a fixed K > 0",
            source=src,
        )
    if uncovered:
        tokens = sum(t for _, t in uncovered)
        say(
            f"{src}: {len(uncovered)} of {len(ids)} responses ({tokens} of {sum(out)} output tokens) not "
            f"covered by their speculative steps, the first at line {uncovered[0][0]}: K = 0 phases, which "
            f"vLLM does not report; the trace counts 0 accepted there and misaligns what follows (record at "
            f"a fixed K > 0)"
        )
    if 0 < len(no_ids) < len(ids):
        # Some responses only: the others' token ids are unused, and the signal went from the whole
        # trace without a word (the summary blamed the server for returning none).
        say(
            f"{src}: {len(no_ids)} of {len(ids)} responses carry no token ids (choices[0].token_ids, "
            f"prompt_token_ids), the first at line {no_ids[0]}: the trace has no n-gram proposals or "
            f"counts from them"
        )
    arrivals = _arrivals(arrival, lines, src, say)
    meta: dict[str, Any] = {
        "imported_from": "vllm per-request spec decode metrics (detailed)",
        "source_file": file_name_text(p),
        "censored_at_recorded_k": True,
        "note": "counts are exact below the recorded K and censored at it; K = 0 phases are not recorded",
    }
    proposal = ngram_acc = None
    if ngram is not None and ngram_cols:
        cols = ngram_cols
        proposal = np.minimum(np.concatenate([prop for _, prop in cols]), np.int32(max_k))
        meta["ngram"] = {"min_n": ngram[0], "max_n": ngram[1]}
        if method is Method.NGRAM or greedy:
            meta["note"] += (
                f"; acc.ngram computed from the token ids (exact for greedy decoding, capped at {NGRAM_HORIZON})"
            )
        if method is Method.NGRAM:
            acc = [a for a, _ in cols]
        elif greedy:
            ngram_acc = np.concatenate([a for a, _ in cols])
    accs = {method: np.concatenate(acc)}
    if ngram_acc is not None:
        accs[Method.NGRAM] = ngram_acc
    return Trace(
        max_k=max_k,
        methods=tuple(accs),
        ids=tuple(ids),
        classes=tuple(classes),
        prompt_tokens=np.array(prompt, dtype=np.int64),
        output_tokens=np.array(out, dtype=np.int64),
        arrival_s=arrivals,
        acc=accs,
        meta=meta,
        name=p.name.removesuffix(".gz").removesuffix(".jsonl"),
        ngram_proposal=proposal,
    )


# -- exact n-gram counterfactuals from token ids -------------------------------------------------

#: The longest n-gram draft scored per position (acc.ngram is capped here, as the generator's counts).
NGRAM_HORIZON = MAX_K_LIMIT
_TOKEN_ID_MAX = (1 << 31) - 1


def ngram_columns(
    prompt_ids: np.ndarray, output_ids: np.ndarray, *, min_n: int, max_n: int, max_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(acc.ngram, ngram_proposal)`` of one greedy request, from its token ids.

    At output position t the engine holds the prompt and output tokens 0..t. vLLM's matcher
    (``policies.prompt_lookup.match_ngram``: the longest suffix n-gram of min_n..max_n tokens found
    earlier, earliest occurrence) drafts the tokens that followed the match; the proposal is that
    draft's length capped at ``max_k``, and the count is how many of its first ``NGRAM_HORIZON``
    tokens equal the output tokens that really came next (exact under greedy decoding).

    The same matches as ``match_ngram`` at every position, with whole-array operations in memory
    linear in the request's tokens whatever max_n (a few int64 arrays of its length): every n-gram
    gets a rank, equal for equal n-grams, from its (n-1)-gram's rank and its last token, and an
    n-gram's earliest start is the first index of its rank. A suffix n-gram that occurs earlier has
    a suffix (n-1)-gram that does too, so the longest match is the largest n whose suffix starts
    later than its earliest occurrence. (Calling the matcher per position was quadratic in the
    request's length; an index of every n-gram's bytes for each n held ~15 KB a token at max_n 63,
    gigabytes for a 128k-token prompt.)
    """
    tokens = np.concatenate([np.asarray(prompt_ids), np.asarray(output_ids)]).astype(np.int64)
    p, n = len(prompt_ids), len(output_ids)
    total = p + n
    acc = np.zeros(n, dtype=np.int32)
    proposal = np.zeros(n, dtype=np.int32)
    ends = np.arange(p + 1, total + 1, dtype=np.int64)  # tokens the engine holds after output token t
    draft_at = np.full(n, -1, dtype=np.int64)  # where the longest match's continuation starts
    # Dense ranks (< total < 2^26), so that a rank times their count plus a rank fits in int64.
    uniq, inv = np.unique(tokens, return_inverse=True)
    base = np.int64(len(uniq))
    token_rank = inv.astype(np.int64).ravel()
    rank = token_rank
    for m in range(1, min(max_n, total - 1) + 1):
        # The m-grams by start: the (m-1)-gram's rank at i, then token i + m - 1.
        key = rank if m == 1 else rank[: total - m + 1] * base + token_rank[m - 1 :]
        uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
        del key
        if len(uniq) == total - m + 1:
            break  # every m-gram occurs once: no match of m tokens or more anywhere
        rank = inv.astype(np.int64).ravel()
        if m < min_n:
            continue
        # A match must end before the last token (it cannot be the suffix itself): it starts at >= 1.
        at = np.flatnonzero(ends - m >= 1)
        s = ends[at] - m
        earliest = first[rank[s]]
        found = earliest < s
        if not found.any():
            break  # no suffix m-gram occurs earlier: no longer one can
        draft_at[at[found]] = earliest[found] + m  # a longer match replaces a shorter one
    hit = np.flatnonzero(draft_at >= 0)
    st, en = draft_at[hit], ends[hit]
    length = np.minimum(NGRAM_HORIZON, en - st)  # the draft: what followed the match, horizon-capped
    proposal[hit] = np.minimum(length, max_k)
    # The draft's tokens that came next, compared one offset at a time over the positions still
    # agreeing (a draft ends before the position it is scored at: st + j < en).
    reach = np.minimum(length, total - en)
    alive = np.flatnonzero(reach > 0)
    j = 0
    while len(alive):
        alive = alive[tokens[st[alive] + j] == tokens[en[alive] + j]]
        acc[hit[alive]] += 1
        j += 1
        alive = alive[reach[alive] > j]
    return acc, proposal


def _token_ids(v: Any, fld: str, fail: Any, *, min_len: int) -> np.ndarray:
    if not isinstance(v, list) or len(v) < min_len:
        raise fail(fld, f"required: a list of at least {min_len} token ids")
    bad = _bad_int_list(v, 0, _TOKEN_ID_MAX)
    if bad is not None:
        raise fail(f"{fld}[{bad}]", f"must be a token id 0..{_TOKEN_ID_MAX}, got {shown(v[bad])}")
    return np.asarray(v, dtype=np.int64)


def import_token_ids(
    path: str | Path,
    *,
    min_n: int = 4,
    max_n: int = 5,
    max_k: int = 8,
    limits: TraceLimits = DEFAULT_LIMITS,
    warn: Callable[[str], None] | None = None,
) -> Trace:
    """A trace with exact ``acc.ngram`` and ``ngram_proposal`` from JSON Lines of greedy token ids.

    Each line: ``{"prompt_token_ids": [...], "output_token_ids": [...]}`` with optional ``id``,
    ``class`` (or ``traffic_class``), ``arrival_s`` and ``acc`` (per-position counts of other methods,
    e.g. ``{"eagle3": [...]}``, ``output_token_ids`` entries each; on every line or on none).
    """
    if not 1 <= min_n <= max_n <= MAX_NGRAM:
        raise ValueError(f"--min-n/--max-n: need 1 <= min_n <= max_n <= {MAX_NGRAM}, got {min_n}, {max_n}")
    if not 1 <= max_k <= MAX_K_LIMIT:
        raise ValueError(f"--max-k: must be 1..{MAX_K_LIMIT}, got {max_k}")
    say = warn or _to_stderr
    p = input_path(path)
    src = str(p)
    ids: list[str] = []
    seen: set[str] = set()
    classes: list[str] = []
    prompt: list[int] = []
    out: list[int] = []
    arrival: list[float] = []
    ngram: list[np.ndarray] = []
    proposals: list[np.ndarray] = []
    other: dict[Method, list[np.ndarray]] = {}
    other_methods: tuple[Method, ...] | None = None
    lines: list[int] = []
    for lineno, text in read_json_lines(p, limits):

        def fail(fld: str, msg: str, lineno: int = lineno) -> TraceError:
            return TraceError(msg, source=src, line=lineno, field=fld)

        obj = load_json_line(text, source=src, line=lineno, limits=limits)
        if not isinstance(obj, dict):
            raise fail("", "expected a JSON object with prompt_token_ids and output_token_ids")
        pids = _token_ids(obj.get("prompt_token_ids"), "prompt_token_ids", fail, min_len=0)
        oids = _token_ids(obj.get("output_token_ids"), "output_token_ids", fail, min_len=1)
        # Each list against its own limit: one message for both blamed the output for a long prompt.
        for fld, tokens, most in (
            ("prompt_token_ids", pids, MAX_PROMPT_TOKENS),
            ("output_token_ids", oids, MAX_OUTPUT_TOKENS),
        ):
            if len(tokens) > most:
                raise fail(fld, f"{len(tokens)} tokens, at most {most} (the trace format's limit)")
        acc_raw = obj.get("acc", {})
        if not isinstance(acc_raw, dict):
            raise fail("acc", 'must be an object such as {"eagle3": [counts...]}')
        methods = []
        for key, v in acc_raw.items():
            if key not in {m.value for m in TRACE_METHODS} or key == Method.NGRAM.value:
                raise fail(f"acc.{key}", "unknown method (eagle3 or p_eagle; ngram is computed)")
            if not isinstance(v, list) or len(v) != len(oids):
                raise fail(f"acc.{key}", f"must be a list of {len(oids)} counts (one per output token)")
            bad = _bad_int_list(v, 0, MAX_COUNT)
            if bad is not None:
                raise fail(f"acc.{key}[{bad}]", f"must be an integer 0..{MAX_COUNT}, got {shown(v[bad])}")
            methods.append(Method(key))
            other.setdefault(Method(key), []).append(np.asarray(v, dtype=np.int32))
        ms = tuple(sorted(methods, key=lambda m: m.value))
        if other_methods is None:
            other_methods = ms
        elif ms != other_methods:
            raise fail(
                "acc", f"methods {[m.value for m in ms]} differ from the first line's (all lines alike)"
            )
        rid, cls = _request_names(obj, lineno, fail)
        if rid in seen:
            raise fail("id", f"duplicate id {shown(rid)}")
        seen.add(rid)
        ids.append(rid)
        classes.append(cls)
        arrival.append(_arrival(obj, fail))
        lines.append(lineno)
        prompt.append(len(pids))
        out.append(len(oids))
        a, prop = ngram_columns(pids, oids, min_n=min_n, max_n=max_n, max_k=max_k)
        ngram.append(a)
        proposals.append(prop)
    if not ids:
        raise TraceError("no requests found", source=src)
    _check_decodes(out, src)
    arrivals = _arrivals(arrival, lines, src, say)
    methods_all = (*(other_methods or ()), Method.NGRAM)
    acc = {m: np.concatenate(other[m]) for m in other_methods or ()}
    acc[Method.NGRAM] = np.concatenate(ngram)
    return Trace(
        max_k=max_k,
        methods=methods_all,
        ids=tuple(ids),
        classes=tuple(classes),
        prompt_tokens=np.array(prompt, dtype=np.int64),
        output_tokens=np.array(out, dtype=np.int64),
        arrival_s=arrivals,
        acc=acc,
        meta={
            "imported_from": "token ids (trace import --tokens)",
            "source_file": file_name_text(p),
            "ngram": {"min_n": min_n, "max_n": max_n},
            "note": f"acc.ngram and ngram_proposal computed with vLLM's matcher; exact for greedy decoding; "
            f"acc.ngram capped at {NGRAM_HORIZON}",
        },
        name=p.name.removesuffix(".gz").removesuffix(".jsonl"),
        ngram_proposal=np.concatenate(proposals),
    )
