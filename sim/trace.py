"""The ``spectrace`` v1 trace format: JSON Lines (optionally gzip), a header line, one request per line.

A trace is held in memory as flat numpy columns: per-request metadata, and per method one int32
array of would-be accepted counts for every output position of every request (request ``r`` owns
``acc[m][offsets[r]:offsets[r + 1]]``). Replay reads positions by index, never per-request objects.

Methods given as ``{"alpha": [...]}`` (per-position conditional acceptance probabilities) are
materialised into counts when the trace is read, with a seeded generator, so a replay is repeatable.

``ngram_proposal`` (optional, on every request or on none) is the n-gram proposer's draft length at
every position: 0 where it finds no match, so n-gram cannot accept there. It is what the engine
knows *before* drafting, so a replay may show it to the policy; ``acc`` it may not.

Reading is bounded (``TraceLimits``): file size, decompressed size, line length, JSON nesting and the
physical range of every number are checked, and every breach is a ``FILE:LINE`` error.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from policies.arms import Method
from policies.params import shown
from policies.text import error_text
from sim.files import FileReplacement

FORMAT_VERSION = 1
MAX_K_LIMIT = 64
#: Accepted counts are held in int32 and never exceed a request's output; a larger one is an error.
MAX_COUNT = (1 << 31) - 1
#: Physical ranges of a request's sizes (tokens) and arrival time (seconds, about 31 years).
MAX_OUTPUT_TOKENS = 1 << 22
MAX_PROMPT_TOKENS = 1 << 24
MAX_ARRIVAL_S = 1e9
#: Methods a trace may carry (``off`` drafts nothing, so it has no array).
TRACE_METHODS: tuple[Method, ...] = (Method.EAGLE3, Method.P_EAGLE, Method.NGRAM)
MAX_ERRORS = 50


class TraceError(ValueError):
    """A trace is invalid; ``str()`` reads ``source:line: field: message``."""

    def __init__(self, message: str, *, source: str, line: int | None = None, field: str = "") -> None:
        self.message, self.source, self.line, self.field = message, source, line, field
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class Trace:
    """A validated trace as numpy columns (see the module docstring)."""

    max_k: int
    methods: tuple[Method, ...]
    ids: tuple[str, ...]
    classes: tuple[str, ...]
    prompt_tokens: np.ndarray  # int64, per request
    output_tokens: np.ndarray  # int64, per request, >= 1
    arrival_s: np.ndarray  # float64, per request, NaN where absent
    acc: Mapping[Method, np.ndarray]  # int32, flat over all output positions
    meta: Mapping[str, Any] = field(default_factory=dict)
    name: str = "trace"
    #: int32, flat like ``acc``: the n-gram proposer's draft length per position (None: not recorded).
    ngram_proposal: np.ndarray | None = None

    @property
    def has_ngram_proposal(self) -> bool:
        return self.ngram_proposal is not None

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.output_tokens)])

    @property
    def total_output_tokens(self) -> int:
        return int(self.output_tokens.sum())

    @property
    def has_arrivals(self) -> bool:
        return self.n > 0 and not bool(np.isnan(self.arrival_s).any())

    def class_names(self) -> list[str]:
        return sorted(set(self.classes))

    def class_index(self) -> tuple[np.ndarray, list[str]]:
        names = self.class_names()
        pos = {c: i for i, c in enumerate(names)}
        return np.array([pos[c] for c in self.classes], dtype=np.int64), names

    def subset(self, index: Sequence[int] | np.ndarray, *, name: str | None = None) -> Trace:
        """The requests at ``index`` (in that order), as a new trace."""
        idx = np.asarray(index, dtype=np.int64)
        off = self.offsets
        flat = (
            np.concatenate([np.arange(off[i], off[i + 1]) for i in idx])
            if len(idx)
            else np.zeros(0, np.int64)
        )
        return Trace(
            max_k=self.max_k,
            methods=self.methods,
            ids=tuple(self.ids[i] for i in idx),
            classes=tuple(self.classes[i] for i in idx),
            prompt_tokens=self.prompt_tokens[idx],
            output_tokens=self.output_tokens[idx],
            arrival_s=self.arrival_s[idx],
            acc={m: a[flat] for m, a in self.acc.items()},
            meta=dict(self.meta),
            name=name or self.name,
            ngram_proposal=None if self.ngram_proposal is None else self.ngram_proposal[flat],
        )


# -- reading -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceLimits:
    """What a reader accepts before it refuses a file (each breach is a ``FILE:LINE`` error).

    Defaults fit a trace of a million long requests; they exist so a hostile or broken file (a gzip
    bomb, one 200 MB line, 100k nested brackets) costs bounded memory and time, not so real traces fail.
    """

    max_file_bytes: int = 4 << 30
    max_decompressed_bytes: int = 16 << 30
    max_line_bytes: int = 64 << 20
    max_depth: int = 32
    #: Blank lines are read one at a time: a 400 KB gzip of 400M newlines took minutes to refuse.
    max_blank_lines: int = 1 << 20

    def __post_init__(self) -> None:
        for f in (
            "max_file_bytes",
            "max_decompressed_bytes",
            "max_line_bytes",
            "max_depth",
            "max_blank_lines",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TraceLimits.{f}: must be an integer >= 1, got {v!r}")


DEFAULT_LIMITS = TraceLimits()


def _open_bytes(path: Path) -> IO[bytes]:
    raw = path.open("rb")
    # gzip's magic is peeked at, not read and sought back from: a pipe (`<(zcat t.jsonl.gz)`, a FIFO)
    # cannot seek, and was refused as "File or stream is not seekable".
    head = raw.peek(2)[:2]
    if head == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    return raw


def _depth_ok(text: str, max_depth: int) -> bool:
    """Whether no bracket nests deeper than ``max_depth`` (strings skipped); before json.loads, whose
    recursion would otherwise end in RecursionError."""
    if text.count("[") + text.count("{") <= max_depth:
        return True
    depth = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def file_name_text(p: Path) -> str:
    """``p``'s name as text: bytes of it that are not UTF-8 written as escapes (``s\\xff.jsonl``). Held
    as Python holds them (lone surrogates) they are no text: a trace named so wrote ``"s\\udcff"`` into
    the result JSON and its report was refused after the whole replay, and the trace writer refused a
    whole import after reading it (the importer's ``source_file``)."""
    return os.fsencode(p.name).decode("utf-8", "backslashreplace")


def input_path(path: str | Path) -> Path:
    """An input file's path as every reader here takes it: TraceError for '' (an unset variable), which
    ``Path`` makes '.', so the error named the directory '.' ("cannot read: Is a directory")."""
    if isinstance(path, str) and not path:
        raise TraceError("not a file name", source="''")
    return Path(path)


def read_json_lines(path: Path, limits: TraceLimits = DEFAULT_LIMITS) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of a JSON Lines file (gzip or plain), bounded.

    Raises TraceError (``FILE:LINE``) when the file, its decompressed text or a line is over its
    limit, and ``cannot read`` for I/O, gzip and UTF-8 errors. Use ``load_json_line`` on each line.
    """
    source = str(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise TraceError(f"cannot read: {error_text(e)}", source=source) from None
    if size > limits.max_file_bytes:
        raise TraceError(f"file is {size} bytes, over the limit of {limits.max_file_bytes}", source=source)
    lineno = 0
    total = 0
    blank = 0
    try:
        with _open_bytes(path) as f:
            while True:
                # readline(n) never holds more than n bytes of one line in memory. Lines are read as
                # bytes and decoded one at a time, so a byte that is not UTF-8 is reported on its own
                # line (a text stream decodes in chunks and fails on an earlier line, or on none).
                raw = f.readline(limits.max_line_bytes + 1)
                if not raw:
                    return
                lineno += 1
                total += len(raw)
                if total > limits.max_decompressed_bytes:
                    raise TraceError(
                        f"decompressed text exceeds the limit of {limits.max_decompressed_bytes} bytes",
                        source=source,
                        line=lineno,
                    )
                if len(raw) > limits.max_line_bytes:
                    raise TraceError(
                        f"line longer than the limit of {limits.max_line_bytes} characters",
                        source=source,
                        line=lineno,
                    )
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TraceError(
                        f"not valid UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)",
                        source=source,
                        line=lineno,
                    ) from None
                if text.strip():
                    yield lineno, text
                else:
                    blank += 1
                    if blank > limits.max_blank_lines:
                        raise TraceError(
                            f"more than {limits.max_blank_lines} blank lines", source=source, line=lineno
                        )
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise TraceError(f"cannot read: {error_text(e)}", source=source, line=lineno or None) from None


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _RepeatedKey(k)
            seen.add(k)
    return out


def load_json_line(text: str, *, source: str, line: int, limits: TraceLimits = DEFAULT_LIMITS) -> Any:
    """One line's JSON value; TraceError (``FILE:LINE``) when invalid, nested too deep or holding an
    integer too long to convert. Every JSON Lines reader of the simulator goes through it."""
    if not _depth_ok(text, limits.max_depth):
        raise TraceError(f"JSON nested deeper than {limits.max_depth} levels", source=source, line=line)
    # The line's own newline goes: an error at its end (a line cut off) is then at its last column + 1,
    # not at "column 1" of the line after it.
    body = text.rstrip("\r\n")
    try:
        value = json.loads(body, object_pairs_hook=_no_repeated_keys, parse_constant=_NotJson)
    except _RepeatedKey as e:  # JSON keeps the last of two equal keys: the first would be dropped unread
        raise TraceError(f"{e.key}: given twice in one object", source=source, line=line) from None
    except json.JSONDecodeError as e:
        at = "at the end of the line: cut off?" if e.pos >= len(body.rstrip()) else f"column {e.pos + 1}"
        raise TraceError(f"invalid JSON: {e.msg} ({at})", source=source, line=line) from None
    except ValueError:  # Python's int-string conversion limit, which is not a JSONDecodeError
        raise TraceError(
            f"invalid JSON: a number longer than {sys.get_int_max_str_digits()} digits",
            source=source,
            line=line,
        ) from None
    except RecursionError:  # a nesting the pre-check missed must still not escape as a traceback
        raise TraceError("JSON nested too deeply", source=source, line=line) from None
    # Python reads NaN, Infinity and -Infinity, which JSON has not: kept, a header's free-form meta
    # took them and a trace written from it held them too. Searched for only where the text names one.
    if ("NaN" in body or "Infinity" in body) and (found := _json_constant(value, "")) is not None:
        where, constant = found
        raise TraceError(f"{constant} is not a JSON number", source=source, line=line, field=where)
    # JSON's \\uD800 escapes decode to lone surrogates, which are not text: they would pass every check
    # and then fail whatever writes them (a report, an imported trace) with half its output written.
    if _SURROGATE_ESCAPE.search(body):
        bad = _not_unicode(value, "")
        if bad is not None:
            raise TraceError(
                "not valid Unicode (a lone UTF-16 surrogate)", source=source, line=line, field=bad
            )
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _NotJson(str):
    """``NaN``, ``Infinity`` or ``-Infinity`` as read (``parse_constant``), found by ``_json_constant``."""


def _json_constant(v: Any, path: str) -> tuple[str, str] | None:
    """``(field path, constant)`` of the first ``_NotJson`` in ``v``, else None."""
    return _first(v, path, lambda x: isinstance(x, _NotJson))


def _not_unicode(v: Any, path: str) -> str | None:
    """The field path of the first string (or key) in ``v`` that holds a lone surrogate, else None."""
    found = _first(v, path, _lone_surrogate)
    return found[0] if found is not None else None


def _lone_surrogate(x: Any) -> bool:
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _first(v: Any, path: str, bad: Callable[[Any], bool]) -> tuple[str, str] | None:
    """``(field path, value)`` of the first value or key in ``v`` (depth first) that is ``bad``, else
    None; a key's path ends in its ``ascii()`` form (a bad key may not print)."""
    if bad(v):
        return path or "(value)", str(v)
    if isinstance(v, dict):
        for k, x in v.items():
            if bad(k):
                return (f"{path}." if path else "") + ascii(k), str(k)
            found = _first(x, f"{path}.{k}" if path else str(k), bad)
            if found is not None:
                return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            found = _first(x, f"{path}[{i}]", bad)
            if found is not None:
                return found
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer beyond any float
        return False


def _int_in(v: Any, lo: int, hi: int) -> bool:
    return _is_int(v) and lo <= v <= hi


def _bad_int_list(v: list[Any], lo: int, hi: int) -> int | None:
    """Index of the first entry of ``v`` that is not an integer in lo..hi, or None.

    Lists of plain integers in range (every valid file's) are answered in C: a check per entry in
    Python took 80 % of a trace's read. Anything else is searched entry by entry for the first bad."""
    if not v:
        return None
    if set(map(type, v)) == {int} and lo <= min(v) and max(v) <= hi:  # (bool's type is not int)
        return None
    return next((i for i, x in enumerate(v) if not _int_in(x, lo, hi)), None)


@dataclass(slots=True)
class _Header:
    max_k: int
    methods: tuple[Method, ...]
    meta: dict[str, Any]


def _check_header(obj: Any, err: Any) -> _Header | None:
    if not isinstance(obj, dict):
        err("", "header must be a JSON object")
        return None
    if not _is_int(obj.get("spectrace")) or obj.get("spectrace") != FORMAT_VERSION:  # not true, not 1.0
        err("spectrace", f"must be {FORMAT_VERSION}, got {shown(obj.get('spectrace'))}")
        return None
    max_k: Any = obj.get("max_k")
    ok = True
    if not _is_int(max_k) or not 1 <= max_k <= MAX_K_LIMIT:
        err("max_k", f"must be an integer 1..{MAX_K_LIMIT}, got {shown(max_k)}")
        ok = False
    methods_raw = obj.get("methods")
    methods: list[Method] = []
    if not isinstance(methods_raw, list) or not methods_raw:
        err("methods", "must be a non-empty list of method names")
        ok = False
    else:
        known = ", ".join(m.value for m in TRACE_METHODS)
        for i, m in enumerate(methods_raw):
            if not isinstance(m, str) or m not in {x.value for x in TRACE_METHODS}:  # [..] is unhashable
                err(f"methods[{i}]", f"unknown method {shown(m)} (known: {known})")
                ok = False
            elif Method(m) in methods:
                err(f"methods[{i}]", f"duplicate method {m!r}")
                ok = False
            else:
                methods.append(Method(m))
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        err("meta", "must be a JSON object")
        ok = False
    elif "ngram" in meta:
        ng = meta["ngram"]
        if not isinstance(ng, dict):
            err("meta.ngram", 'must be an object {"min_n": N, "max_n": M}')
            ok = False
        else:
            lo: Any = ng.get("min_n")
            hi: Any = ng.get("max_n")
            if not _int_in(lo, 1, 1 << 16):
                err("meta.ngram.min_n", f"required: an integer >= 1, got {shown(lo)}")
                ok = False
            elif not _int_in(hi, lo, 1 << 16):
                err("meta.ngram.max_n", f"required: an integer >= min_n ({lo}), got {shown(hi)}")
                ok = False
    return _Header(int(max_k), tuple(methods), dict(meta)) if ok else None


@dataclass(slots=True)
class _Request:
    id: str
    cls: str
    prompt: int
    output: int
    arrival: float
    # counts, or alphas (floats) when ``alpha`` is set; counts as int32 arrays once read (``_compact``)
    acc: dict[Method, list[int] | list[float] | np.ndarray]
    alpha: set[Method]
    proposal: list[int] | np.ndarray | None = None


def _check_request(obj: Any, hdr: _Header, err: Any) -> _Request | None:
    if not isinstance(obj, dict):
        err("", "request must be a JSON object")
        return None
    n_before = err.count
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        err("id", "required: a non-empty string")
    cls = obj.get("class", "default")
    if not isinstance(cls, str) or not cls:
        err("class", "must be a non-empty string")
    prompt: Any = obj.get("prompt_tokens", 0)
    if not _int_in(prompt, 0, MAX_PROMPT_TOKENS):
        err("prompt_tokens", f"must be an integer 0..{MAX_PROMPT_TOKENS}, got {shown(prompt)}")
    out: Any = obj.get("output_tokens")
    if not _int_in(out, 1, MAX_OUTPUT_TOKENS):
        err("output_tokens", f"required: an integer 1..{MAX_OUTPUT_TOKENS}, got {shown(out)}")
        out = None
    arrival: Any = obj.get("arrival_s")
    if arrival is not None and (not _is_num(arrival) or not 0 <= arrival <= MAX_ARRIVAL_S):
        err("arrival_s", f"must be a number 0..{MAX_ARRIVAL_S:g}, got {shown(arrival)}")
    acc_raw = obj.get("acc")
    acc: dict[Method, Any] = {}
    alpha: set[Method] = set()
    if not isinstance(acc_raw, dict):
        err("acc", "required: an object with one entry per method of the header")
    else:
        for m in hdr.methods:
            if m.value not in acc_raw:
                err(f"acc.{m.value}", "missing (every method of the header needs an entry)")
        for key, v in acc_raw.items():
            f = f"acc.{key}"
            if key not in {m.value for m in hdr.methods}:
                err(
                    f,
                    f"method not declared in the header (header: {', '.join(m.value for m in hdr.methods)})",
                )
                continue
            m = Method(key)
            if isinstance(v, dict):
                a = v.get("alpha")
                extra = set(v) - {"alpha"}
                if extra:
                    err(f"{f}.{sorted(extra)[0]}", "unknown field (expected only 'alpha')")
                elif not isinstance(a, list) or len(a) != hdr.max_k:
                    err(f"{f}.alpha", f"must be a list of {hdr.max_k} probabilities (max_k)")
                else:
                    bad = [i for i, x in enumerate(a) if not _is_num(x) or not 0.0 <= float(x) <= 1.0]
                    if bad:
                        err(
                            f"{f}.alpha[{bad[0]}]", f"must be a probability in [0, 1], got {shown(a[bad[0]])}"
                        )
                    else:
                        acc[m] = [float(x) for x in a]
                        alpha.add(m)
            elif isinstance(v, list):
                if out is not None and len(v) != out:
                    err(f, f"length {len(v)} != output_tokens {out}")
                else:
                    bad_at = _bad_int_list(v, 0, MAX_COUNT)
                    if bad_at is not None:
                        err(f"{f}[{bad_at}]", f"must be an integer 0..{MAX_COUNT}, got {shown(v[bad_at])}")
                    else:
                        acc[m] = v
            else:
                err(f, 'must be a list of accepted counts or {"alpha": [...]}')
    proposal = _check_proposal(obj.get("ngram_proposal"), out, acc, alpha, hdr, err)
    if err.count > n_before:
        return None
    assert isinstance(rid, str) and isinstance(out, int)
    return _Request(
        rid,
        str(cls),
        int(prompt),
        out,
        float("nan") if arrival is None else float(arrival),
        acc,
        alpha,
        proposal,
    )


def _check_proposal(
    v: Any, out: int | None, acc: Mapping[Method, Any], alpha: set[Method], hdr: _Header, err: Any
) -> list[int] | None:
    """``ngram_proposal``: ``output_tokens`` integers 0..max_k, consistent with ``acc.ngram``.

    n-gram drafts nothing where it proposes nothing, so it accepts 0 there; a proposal shorter than
    max_k is the whole draft (the history ran out), so it accepts at most that many.
    """
    if v is None:
        return None
    f = "ngram_proposal"
    if not isinstance(v, list):
        err(f, f"must be a list of {out if out is not None else 'output_tokens'} integers 0..max_k")
        return None
    if out is not None and len(v) != out:
        err(f, f"length {len(v)} != output_tokens {out}")
        return None
    bad = _bad_int_list(v, 0, hdr.max_k)
    if bad is not None:
        err(f"{f}[{bad}]", f"must be an integer 0..{hdr.max_k} (max_k), got {shown(v[bad])}")
        return None
    ng = acc.get(Method.NGRAM)
    if ng is not None and Method.NGRAM not in alpha and len(ng) != len(v):
        # Only when output_tokens was itself invalid (else both were checked against it): ``validate``
        # goes on collecting, and the two lists must still agree before they are compared.
        err(f, f"length {len(v)} != acc.ngram length {len(ng)}")
        return None
    if ng is not None and Method.NGRAM not in alpha:
        # Both lists hold checked integers (0..max_k, 0..MAX_COUNT) by now: compared as arrays.
        pv, av = np.asarray(v, dtype=np.int64), np.asarray(ng, dtype=np.int64)
        above = np.flatnonzero((pv < hdr.max_k) & (av > pv))
        if len(above):
            over = int(above[0])
            err(
                f"acc.ngram[{over}]",
                f"{ng[over]} accepted, but ngram_proposal[{over}] = {v[over]}: n-gram cannot accept more "
                "than it proposes",
            )
            return None
    return v


class _Errors:
    """Collects errors; stops the read at the first one unless collecting for ``validate``."""

    def __init__(self, source: str, *, collect: bool) -> None:
        self.source = source
        self.collect = collect
        self.errors: list[TraceError] = []
        self.line = 0

    @property
    def count(self) -> int:
        return len(self.errors)

    def __call__(self, fld: str, message: str) -> None:
        e = TraceError(message, source=self.source, line=self.line, field=fld)
        if not self.collect:
            raise e
        self.errors.append(e)


#: What ``_lines`` yields for a line that could not be read as JSON (its error already collected).
_UNREADABLE = object()


def _lines(path: Path, errs: _Errors, limits: TraceLimits) -> Iterator[tuple[int, Any]]:
    for lineno, text in read_json_lines(path, limits):
        errs.line = lineno
        try:
            yield lineno, load_json_line(text, source=errs.source, line=lineno, limits=limits)
        except TraceError as e:
            errs(e.field, e.message)
            # The line still counts: skipping it made the next request line be checked as the header.
            yield lineno, _UNREADABLE


def _parse(
    path: Path, *, collect: bool, limits: TraceLimits = DEFAULT_LIMITS
) -> tuple[_Header | None, list[_Request], list[TraceError]]:
    errs = _Errors(str(path), collect=collect)
    hdr: _Header | None = None
    reqs: list[_Request] = []
    seen: dict[str, int] = {}
    first = True
    for lineno, obj in _lines(path, errs, limits):
        if first:
            first = False
            hdr = None if obj is _UNREADABLE else _check_header(obj, errs)
            if hdr is None:
                break
            continue
        assert hdr is not None
        if obj is _UNREADABLE:
            if errs.count >= MAX_ERRORS:
                break
            continue
        r = _check_request(obj, hdr, errs)
        _admit(r, lineno, seen, reqs, errs)
        if r is not None:
            _compact(r, keep=not collect)
        if errs.count >= MAX_ERRORS:
            break
    if first:
        errs.line = 1
        errs("", "empty trace: expected a header line")
    elif hdr is not None and not reqs and not errs.errors:
        errs.line = 0
        raise TraceError("no requests after the header", source=str(path))
    if hdr is not None and reqs:
        _check_across(reqs, seen, errs)
    return hdr, reqs, errs.errors


def _compact(r: _Request, *, keep: bool) -> None:
    """A checked request's per-position lists as int32 arrays (``keep``), or dropped (a validation,
    which needs none of them again). Lists cost 8 bytes a position and method where the trace keeps
    4: a trace took 4x its arrays' memory to read (16 bytes a position and method, 6.7x its text)."""
    for m in list(r.acc):
        if m not in r.alpha:
            if keep:
                r.acc[m] = np.asarray(r.acc[m], dtype=np.int32)
            else:
                del r.acc[m]
    if r.proposal is not None:
        r.proposal = np.asarray(r.proposal, dtype=np.int32) if keep else _NO_POSITIONS


#: A validated request's ``ngram_proposal`` once dropped (it was given: ``_check_across`` asks).
_NO_POSITIONS = np.zeros(0, dtype=np.int32)


def _admit(r: _Request | None, lineno: int, seen: dict[str, int], reqs: list[_Request], errs: Any) -> None:
    """A checked request (None: refused) kept, or its id refused as a repeat, naming the first's line."""
    if r is None:
        return
    if r.id in seen:
        errs("id", f"duplicate id {shown(r.id)} (first on line {seen[r.id]})")
    else:
        seen[r.id] = lineno
        reqs.append(r)


def _check_across(reqs: list[_Request], line_of: Mapping[str, int], errs: Any) -> None:
    """The rules across requests, for the reader and the writer alike: ``arrival_s`` and
    ``ngram_proposal`` on all requests or none, and one request with output_tokens >= 2."""
    has = [not math.isnan(r.arrival) for r in reqs]
    if any(has) and not all(has):
        errs.line = line_of[next(r.id for r in reqs if math.isnan(r.arrival))]
        errs("arrival_s", "given on some requests but not on this one (all or none)")
    has = [r.proposal is not None for r in reqs]
    if any(has) and not all(has):
        errs.line = line_of[next(r.id for r in reqs if r.proposal is None)]
        errs("ngram_proposal", "given on some requests but not on this one (all or none)")
    if not errs.errors and all(r.output == 1 for r in reqs):
        # Prefill makes each request's one token: no decode step would run, nothing to compare.
        errs.line = line_of[reqs[0].id]
        errs("output_tokens", "every request has output_tokens 1: a replay needs one with >= 2")


def sample_counts(alpha: Sequence[float] | np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` accepted counts from conditional per-position acceptance probabilities (a chain draft).

    Count j is reached when positions 1..j are all accepted, so P(count >= j) = alpha_1 * ... * alpha_j.
    """
    a = np.asarray(alpha, dtype=np.float64)
    u = rng.random((n, len(a)))
    ok = u < a[None, :]
    # The count is the number of leading accepted positions.
    counts: np.ndarray = np.argmin(np.concatenate([ok, np.zeros((n, 1), bool)], axis=1), axis=1)
    return counts.astype(np.int32)


def validate_trace(path: str | Path, *, limits: TraceLimits = DEFAULT_LIMITS) -> list[TraceError]:
    """Every problem found (up to ``MAX_ERRORS``), each with its line and field; empty when valid."""
    try:
        _, _, errors = _parse(input_path(path), collect=True, limits=limits)
    except TraceError as e:
        return [e]
    return errors


def read_trace(path: str | Path, *, seed: int = 0, limits: TraceLimits = DEFAULT_LIMITS) -> Trace:
    """Read and validate a trace; raises TraceError at the first problem."""
    p = input_path(path)
    hdr, reqs, _ = _parse(p, collect=False, limits=limits)
    assert hdr is not None
    rng = np.random.default_rng(seed)
    acc: dict[Method, np.ndarray] = {}
    for m in hdr.methods:
        parts = []
        for r in reqs:
            v = r.acc[m]
            if m not in r.alpha:
                parts.append(np.asarray(v, dtype=np.int32))
                continue
            drawn = sample_counts(v, r.output, rng)
            if m is Method.NGRAM and r.proposal is not None:
                # n-gram cannot accept more than it proposes (nothing where it finds no match), as the
                # reader requires of given counts
                drawn = np.minimum(drawn, np.asarray(r.proposal, dtype=drawn.dtype))
            parts.append(drawn)
        acc[m] = np.concatenate(parts).astype(np.int32, copy=False)
        # Each method's per-request arrays go once joined: the peak is the trace plus one method's.
        del parts
        for r in reqs:
            if m not in r.alpha:
                del r.acc[m]
    name = file_name_text(p)
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return Trace(
        max_k=hdr.max_k,
        methods=hdr.methods,
        ids=tuple(r.id for r in reqs),
        classes=tuple(r.cls for r in reqs),
        prompt_tokens=np.array([r.prompt for r in reqs], dtype=np.int64),
        output_tokens=np.array([r.output for r in reqs], dtype=np.int64),
        arrival_s=np.array([r.arrival for r in reqs], dtype=np.float64),
        acc=acc,
        meta=hdr.meta,
        name=name,
        ngram_proposal=(
            np.concatenate([np.asarray(r.proposal, dtype=np.int32) for r in reqs])
            if reqs[0].proposal is not None
            else None
        ),
    )


# -- writing -------------------------------------------------------------------------------------


class _WriteErrors:
    """``_check_header``/``_check_request``'s error sink for the writer: raises at the first problem,
    naming the request (its index, id and the line it would have)."""

    count = 0
    errors: tuple[str, ...] = ()  # it raises at the first: none are collected

    def __init__(self, source: str) -> None:
        self.source = source
        self.line: int | None = None
        self.what = ""

    def __call__(self, fld: str, message: str) -> None:
        raise TraceError(
            f"{message} ({self.what}; not written: read_trace would refuse it)" if self.what else message,
            source=self.source,
            line=self.line,
            field=fld,
        )


def _request_named(trace: Trace, i: int) -> str:
    rid = trace.ids[i] if i < len(trace.ids) else None
    return f"request {i}, id {shown(rid)}"


def _check_columns(trace: Trace, hdr: _Header, err: _WriteErrors) -> None:
    """Some requests, and columns of matching lengths: what a Trace can get wrong that no line shows
    (the rules within and across requests are the reader's own, applied as the lines are made)."""
    n = trace.n
    err.line = None
    if n == 0:
        err("", "no requests: a trace needs at least one")
    for col in ("classes", "prompt_tokens", "output_tokens", "arrival_s"):
        length = len(getattr(trace, col))
        if length != n:
            err(col, f"{length} values for {n} requests (ids)")
    for m in hdr.methods:
        if m not in trace.acc:
            err(f"acc.{m.value}", "missing (every method of the header needs an array)")


def _checked_line(rec: dict[str, Any], limits: TraceLimits, err: _WriteErrors) -> str:
    try:
        # allow_nan=False: NaN and Infinity are no JSON, and the reader refuses them
        line = json.dumps(rec, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:  # not JSON (a set, an object), an integer over Python's limit
        err("meta" if "meta" in rec else "", f"cannot be written as JSON: {e}")
    # ensure_ascii: one character is one byte; the reader counts the newline too
    if len(line) + 1 > limits.max_line_bytes:
        err("", f"line longer than the limit of {limits.max_line_bytes} characters")
    return line


def trace_lines(
    trace: Trace, *, source: str | None = None, limits: TraceLimits = DEFAULT_LIMITS
) -> Iterator[str]:
    """The trace as spectrace v1 lines (without newlines).

    Each line is checked with the reader's own rules before it is yielded (``_check_header``,
    ``_check_request``, the cross-request rules, Unicode, nesting and line length): what
    ``read_trace`` would refuse raises TraceError, ``SOURCE:LINE: field: message (request I, id ...)``,
    so the writer never writes a file its reader refuses. ``arrival_s`` is written exactly (Python's
    shortest decimal that reads back as the same float64).
    """
    err = _WriteErrors(source if source is not None else trace.name)
    err.line = 1
    header: dict[str, Any] = {
        "spectrace": FORMAT_VERSION,
        "max_k": trace.max_k,
        "methods": [m.value if isinstance(m, Method) else m for m in trace.methods],
        "meta": dict(trace.meta),
    }
    hdr = _check_header(header, err)
    assert hdr is not None  # else ``err`` raised
    bad = _not_unicode(header["meta"], "meta")
    if bad is not None:
        err(bad, "not valid Unicode (a lone UTF-16 surrogate)")
    line = _checked_line(header, limits, err)
    if not _depth_ok(line, limits.max_depth):
        err("meta", f"JSON nested deeper than {limits.max_depth} levels")
    _check_columns(trace, hdr, err)
    yield line
    off = trace.offsets
    seen: dict[str, int] = {}
    reqs: list[_Request] = []
    for i in range(trace.n):
        err.line, err.what = i + 2, _request_named(trace, i)
        rec: dict[str, Any] = {"id": trace.ids[i], "class": trace.classes[i]}
        arrival = float(trace.arrival_s[i])
        if not math.isnan(arrival):
            rec["arrival_s"] = arrival
        rec["prompt_tokens"] = int(trace.prompt_tokens[i])
        rec["output_tokens"] = int(trace.output_tokens[i])
        rec["acc"] = {m.value: trace.acc[m][off[i] : off[i + 1]].tolist() for m in hdr.methods}
        if trace.ngram_proposal is not None:
            rec["ngram_proposal"] = trace.ngram_proposal[off[i] : off[i + 1]].tolist()
        r = _check_request(rec, hdr, err)
        _admit(r, i + 2, seen, reqs, err)
        if r is not None:
            # Only what the rules across requests ask is kept: every request's lists of Python ints
            # (36 bytes a position and column) were held to the end, 4x the trace's own arrays.
            _compact(r, keep=False)
        for fld in ("id", "class"):
            if _not_unicode(rec[fld], fld) is not None:
                err(fld, "not valid Unicode (a lone UTF-16 surrogate)")
        yield _checked_line(rec, limits, err)
    err.what = ""
    _check_across(reqs, seen, err)
    # Positions past the last request's would be dropped unwritten (checked last: a bad output_tokens
    # is named by its request above).
    err.line = None
    positions = int(off[-1])
    columns = {f"acc.{m.value}": trace.acc[m] for m in hdr.methods}
    if trace.ngram_proposal is not None:
        columns["ngram_proposal"] = trace.ngram_proposal
    for col, a in columns.items():
        if len(a) != positions:
            err(col, f"{len(a)} positions, but output_tokens sum to {positions}")


#: Text gathered before a write to the file: the writer holds this much (and one line) of the trace's
#: text, not all of it.
_WRITE_CHUNK_BYTES = 1 << 20


def write_trace(trace: Trace, path: str | Path, *, limits: TraceLimits = DEFAULT_LIMITS) -> None:
    """Write a trace; gzip-compressed when the name ends in ``.gz``.

    Raises TraceError (and writes nothing) when ``read_trace`` would refuse the file (see
    ``trace_lines``). The text is streamed in chunks of ``_WRITE_CHUNK_BYTES`` to ``NAME.tmp``, renamed
    over ``NAME`` once whole (as ``sim.files.replace_file`` writes): the whole text, and its gzip,
    were held in memory at once (several times the trace's arrays, gigabytes for hours of steps).
    The bytes are those of ``gzip.compress(text, mtime=0)`` (or the text), as they were."""
    p = Path(path)
    gz = p.suffix == ".gz"
    # gzip.compress(text, mtime=0) is zlib's own gzip wrapper (wbits 31) at level 9: the same stream.
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31) if gz else None
    text_bytes = file_bytes = 0
    out: FileReplacement | None = None
    chunk: list[bytes] = []
    held = 0

    def emit(data: bytes, *, last: bool = False) -> None:
        nonlocal file_bytes, out
        if deflate is not None:
            data = deflate.compress(data) + (deflate.flush() if last else b"")
        file_bytes += len(data)
        if text_bytes > limits.max_decompressed_bytes or file_bytes > limits.max_file_bytes:
            # Over a limit: the rest is still made (its lines checked, the sizes counted for the
            # message, as before), none of it written.
            if out is not None:
                out.discard()
            return
        if out is None:  # opened once the first chunk is made: a small trace is checked whole first
            out = FileReplacement(p)
        out.write(data)

    try:
        for line in trace_lines(trace, source=str(p), limits=limits):
            data = (line + "\n").encode("utf-8")
            text_bytes += len(data)
            chunk.append(data)
            held += len(data)
            if held >= _WRITE_CHUNK_BYTES:
                emit(b"".join(chunk))
                chunk, held = [], 0
        emit(b"".join(chunk), last=True)
        if text_bytes > limits.max_decompressed_bytes:
            raise TraceError(
                f"{text_bytes} bytes of text, over the reader's limit of {limits.max_decompressed_bytes}",
                source=str(p),
            )
        if file_bytes > limits.max_file_bytes:
            raise TraceError(
                f"{file_bytes} bytes, over the reader's limit of {limits.max_file_bytes}", source=str(p)
            )
        assert out is not None  # (the last chunk holds the header line at least)
        out.commit()
    finally:
        if out is not None:
            out.discard()
