"""Step telemetry files (``speccontrol-steps/1``): what ``serve --record-steps`` writes, ``profile fit`` reads.

JSON Lines, one engine step per line, in the order the sidecar applied them::

    {"engine": "pod-1", "time_s": 12.5, "duration_s": 0.0123, "batch": 8, "prefill_tokens": 0,
     "kv_tokens": null, "decoded_tokens": 1830, "method": ["eagle3", ...], "k": [3, ...],
     "accepted": [2, ...]}

* ``duration_s``: the step's wall time (draft + verify + overhead), 1 us..1 h, and at least
  50 ns per request of its batch (``policies.physics``, the bounds the sidecar holds steps to).
* ``batch``: running requests; ``method``/``k``/``accepted``: one entry per reported request (the
  method whose draft was verified, ``off`` for none).
* ``prefill_tokens``: prompt tokens computed in the same step (0: none or unknown).
* ``kv_tokens``: tokens in the KV cache of the step's requests when the engine reports them, else null.
  The wire protocol does not carry them, so the sidecar writes null and ``decoded_tokens``: the tokens
  its requests had emitted in earlier reported steps (known exactly from request ids; prompts excluded).

Reading validates every line and names the first bad one as ``FILE:LINE: field: message``; nothing is
returned for a bad file, but for a last line cut mid-way (no newline ends it, and it is not JSON: a
sidecar still writing, or killed inside a write), which is left out and said. Writing never raises into the sidecar: a failed write is logged once and the
recorder stops (the engine's reports are still applied). The file holds whole lines only when a
recording starts: a half line a killed sidecar left is cut first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from policies.arms import METHOD_CODES, Method
from policies.observation import StepObservation
from policies.params import shown
from policies.physics import MAX_STEP_S, MIN_STEP_S, MIN_STEP_S_PER_REQUEST, step_floor_s
from sim.trace import TraceError, input_path, load_json_line, read_json_lines

log = logging.getLogger(__name__)

FORMAT = "speccontrol-steps/1"
#: Requests whose emitted tokens the recorder remembers per engine (oldest forgotten first).
MAX_TRACKED_REQUESTS = 100_000
_NAMES = {code: m.value for m, code in METHOD_CODES.items()}
_MAX_K = 64
#: Physical ranges of a step, those the sidecar's telemetry checks (controller.validation) hold every
#: recorded step to: a step lasts 1 us..1 h and 50 ns per request of its batch (policies.physics),
#: batches are under a million requests, a step prefills at most 2^22 prompt tokens, and clocks stay
#: below 1e11 s. Tokens held by a step's requests: a million requests of 2^22 tokens. Beyond them a
#: line is garbage, and the fit's arrays overflow.
MAX_BATCH = 1 << 20
MAX_PREFILL_TOKENS = 1 << 22
MAX_TOKENS = 1 << 42
MAX_TIME_S = 1e11


class StepLogError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class StepLog:
    """Recorded steps as columns: per step (``n`` entries) and per request row (``rows`` entries)."""

    source: str
    engine: tuple[str, ...]
    duration_s: np.ndarray
    batch: np.ndarray
    prefill_tokens: np.ndarray
    kv_tokens: np.ndarray | None  # None unless every step reported them
    decoded_tokens: np.ndarray
    time_s: np.ndarray  # the engine's clock at the end of each step
    row_step: np.ndarray  # the step of each request row
    method: np.ndarray  # int8 method codes
    k: np.ndarray
    accepted: np.ndarray

    @property
    def n(self) -> int:
        return len(self.duration_s)

    def select(self, keep: np.ndarray) -> StepLog:
        """The steps where ``keep`` (one bool per step) holds, rows with them."""
        keep = np.asarray(keep, dtype=bool)
        rows = keep[self.row_step]
        renumber = np.cumsum(keep) - 1
        return StepLog(
            source=self.source,
            engine=tuple(e for e, k in zip(self.engine, keep, strict=True) if k),
            duration_s=self.duration_s[keep],
            batch=self.batch[keep],
            prefill_tokens=self.prefill_tokens[keep],
            kv_tokens=None if self.kv_tokens is None else self.kv_tokens[keep],
            decoded_tokens=self.decoded_tokens[keep],
            time_s=self.time_s[keep],
            row_step=renumber[self.row_step[rows]],
            method=self.method[rows],
            k=self.k[rows],
            accepted=self.accepted[rows],
        )

    def emitted_tokens(self) -> int:
        """Tokens the steps emitted: accepted drafts plus one per request row."""
        return int(self.accepted.sum()) + len(self.accepted)


def step_record(
    engine: str, obs: StepObservation, *, decoded_tokens: int, kv_tokens: int | None = None
) -> dict[str, Any]:
    """One line of the file for one applied step."""
    return {
        "engine": engine,
        "time_s": obs.time_s,
        "duration_s": obs.duration_s,
        "batch": obs.batch_size,
        "prefill_tokens": obs.prefill_tokens,
        "kv_tokens": kv_tokens,
        "decoded_tokens": decoded_tokens,
        "method": [_NAMES[int(c)] for c in obs.method],
        "k": [int(x) for x in obs.k],
        "accepted": [int(x) for x in obs.accepted],
    }


class StepRecorder:
    """Appends applied steps to a ``speccontrol-steps/1`` file; call it as ``recorder(engine_id, steps)``.

    Never raises into the sidecar: a failed write is logged once, the file is cut back to its last whole
    line (a half-written line made ``profile fit`` refuse the whole file) and the recording stops. A file
    removed or replaced while recording (rotated, or deleted by mistake) is said once and made anew at
    the path: the steps went on into the removed file, and the log said they were in ``path``. A half
    line at the end of the file when recording starts (a sidecar killed inside a write) is cut first:
    the next step appended to it made one broken line in the middle, and the whole file unreadable."""

    #: How often (seconds) the path is checked to still name the file written.
    CHECK_EVERY_S = 1.0

    def __init__(self, *, path: Path) -> None:
        self.path = path
        self.steps = 0
        #: Of ``steps``, those in the file at ``path`` now (the rest went to one removed while recording).
        self.steps_at_path = 0
        _cut_half_line(path)
        self._file: IO[str] | None = path.open("a", encoding="utf-8")
        self._whole = self._end()
        self._checked = time.monotonic()
        self._emitted: dict[str, OrderedDict[str, int]] = {}

    def _end(self) -> int | None:
        """The file's size: where its last whole line ends (None: not a regular file, never cut)."""
        assert self._file is not None
        st = os.fstat(self._file.fileno())
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _same_file(self) -> bool:
        assert self._file is not None
        try:
            here, ours = os.stat(self.path), os.fstat(self._file.fileno())
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino)

    def _reopen_if_moved(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.CHECK_EVERY_S or self._file is None:
            return
        self._checked = now
        if self._same_file():
            return
        log.warning(
            "--record-steps %s: removed or replaced while recording (after %d steps); recording into a new %s",
            self.path,
            self.steps,
            self.path,
        )
        old, self._file = self._file, None
        with contextlib.suppress(OSError):
            old.close()
        _cut_half_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._whole = self._end()
        self.steps_at_path = 0

    def __call__(self, engine: str, observations: Iterable[StepObservation]) -> None:
        if self._file is None:
            return
        try:
            self._record(engine, observations)
        except Exception as e:  # the recording is a bystander: it must not fail the engine's report
            log.error("--record-steps %s: %s; recording stopped after %d steps", self.path, e, self.steps)
            self._stop_whole()

    def _record(self, engine: str, observations: Iterable[StepObservation]) -> None:
        self._reopen_if_moved()
        assert self._file is not None
        seen = self._emitted.setdefault(engine, OrderedDict())
        lines = []
        for obs in observations:
            decoded = 0
            for j, rid in enumerate(obs.request_id):
                if not rid:
                    continue
                decoded += seen.get(rid, 0)
                seen[rid] = seen.get(rid, 0) + int(obs.accepted[j]) + 1
                if obs.finished is not None and obs.finished[j]:
                    del seen[rid]
            while len(seen) > MAX_TRACKED_REQUESTS:
                seen.popitem(last=False)
            lines.append(json.dumps(step_record(engine, obs, decoded_tokens=decoded), separators=(",", ":")))
        text = "".join(line + "\n" for line in lines)
        self._file.write(text)
        self._file.flush()
        self.steps += len(lines)
        self.steps_at_path += len(lines)
        if self._whole is not None:
            self._whole += len(text.encode("utf-8"))

    def _stop_whole(self) -> None:
        """Closes the file cut back to its last whole line: a half-written batch made the whole file
        unreadable. Cut after the close, which tries the buffered rest once more."""
        f, self._file = self._file, None
        if f is None:
            return
        fd = -1
        with contextlib.suppress(OSError, ValueError):
            fd = os.dup(f.fileno())
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(OSError):
            f.close()  # a close whose flush failed leaves the file open
        if fd >= 0:
            with contextlib.suppress(OSError):
                if self._whole is not None:
                    os.ftruncate(fd, self._whole)
            os.close(fd)

    def close(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()
            except OSError as e:
                with contextlib.suppress(OSError):
                    f.close()
                log.error("--record-steps %s: %s", self.path, e)


def _cut_half_line(path: Path) -> None:
    """Cut a regular file at ``path`` back to its last whole line, saying what was cut. Anything else
    there (nothing yet, a FIFO, a device) is left as it is; a file that cannot be read or cut is left
    to the append, whose own errors say so."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not st.st_size:
            return
        end = pos = st.st_size
        while pos > 0:  # back from the end to the last newline, a chunk at a time
            start = max(0, pos - 65536)
            at = os.pread(fd, pos - start, start).rfind(b"\n")
            if at >= 0:
                pos = start + at + 1
                break
            pos = start
        if pos < end:
            os.ftruncate(fd, pos)
            log.warning("--record-steps %s: cut %d bytes of a half-written last line", path, end - pos)
    except OSError as e:
        log.warning("--record-steps %s: could not check its last line: %s", path, e)
    finally:
        os.close(fd)


# -- reading ---------------------------------------------------------------------------------------


def _int(d: dict[str, Any], key: str, where: str, *, hi: int, null: bool = False) -> int | None:
    v = d.get(key)
    if v is None and null and key in d:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise StepLogError(f"{where}: {key}: expected an integer 0..{hi}, got {shown(v)}")
    return v


def _ints(d: dict[str, Any], key: str, where: str, n: int | None) -> list[int]:
    v = d.get(key)
    if not isinstance(v, list):
        raise StepLogError(f"{where}: {key}: expected a list, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise StepLogError(f"{where}: {key}: expected {n} entries (one per method), got {len(v)}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= _MAX_K:
            raise StepLogError(f"{where}: {key}[{i}]: expected an integer 0..{_MAX_K}, got {shown(x)}")
    return v


def _seconds(d: dict[str, Any], key: str, where: str, lo: float, hi: float, default: Any = None) -> float:
    v = d.get(key, default)
    # Comparisons, not float(): an integer beyond a double's range compares, where float() overflows.
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise StepLogError(f"{where}: {key}: expected a number {lo:g}..{hi:g}, got {shown(v)}")
    return float(v)


def parse_step(d: Any, where: str) -> tuple[dict[str, Any], list[int], list[int], list[int]]:
    """Validates one line; returns (step fields, method codes, k, accepted)."""
    if not isinstance(d, dict):
        raise StepLogError(f"{where}: expected a JSON object, got {type(d).__name__}")
    eng = d.get("engine", "")
    if not isinstance(eng, str):
        raise StepLogError(f"{where}: engine: expected a string, got {eng!r}")
    dur = _seconds(d, "duration_s", where, MIN_STEP_S, MAX_STEP_S)
    methods = d.get("method")
    if not isinstance(methods, list):
        raise StepLogError(f"{where}: method: expected a list, got {type(methods).__name__}")
    codes = []
    for i, m in enumerate(methods):
        try:
            codes.append(METHOD_CODES[Method(m)])
        except (ValueError, TypeError):
            known = ", ".join(x.value for x in Method)
            raise StepLogError(f"{where}: method[{i}]: unknown method {m!r} (known: {known})") from None
    ks = _ints(d, "k", where, len(codes))
    acc = _ints(d, "accepted", where, len(codes))
    off = METHOD_CODES[Method.OFF]
    for i, (c, a, k) in enumerate(zip(codes, acc, ks, strict=True)):
        if a > k:
            raise StepLogError(f"{where}: accepted[{i}]: {a} accepted of a draft of k = {k}")
        if c == off and k:
            raise StepLogError(f"{where}: k[{i}]: a draft of k = {k} with method off (which drafts nothing)")
    batch = _int(d, "batch", where, hi=MAX_BATCH) or 0
    if batch < len(codes):
        raise StepLogError(f"{where}: batch: {batch} running but {len(codes)} requests reported")
    if dur < step_floor_s(batch):
        raise StepLogError(
            f"{where}: duration_s: {dur:g} s for a batch of {batch} requests is faster than any engine "
            f"(at least {MIN_STEP_S_PER_REQUEST:g} s per request)"
        )
    fields = {
        "engine": eng,
        "duration_s": dur,
        "time_s": _seconds(d, "time_s", where, 0.0, MAX_TIME_S, 0.0),
        "batch": batch,
        "prefill_tokens": _int(d, "prefill_tokens", where, hi=MAX_PREFILL_TOKENS),
        "kv_tokens": _int(d, "kv_tokens", where, hi=MAX_TOKENS, null=True) if "kv_tokens" in d else None,
        "decoded_tokens": _int(d, "decoded_tokens", where, hi=MAX_TOKENS) if "decoded_tokens" in d else 0,
    }
    return fields, codes, ks, acc


class _Column:
    """Values appended one at a time, kept in numpy chunks of a compact dtype.

    A Python list costs 8 bytes a value for the reference alone (a float or a large int another 24-32),
    and the per-step dicts read_steps kept cost ~0.5 KB a step: a 130 MB step file took 480 MB. Here a
    value costs its dtype's bytes once flushed; at most ``CHUNK`` values wait in a list."""

    CHUNK = 1 << 14

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self.pending: list[Any] = []
        self.chunks: list[np.ndarray] = []

    def add(self, v: Any) -> None:
        self.pending.append(v)
        if len(self.pending) >= self.CHUNK:
            self.flush()

    def extend(self, vs: Sequence[Any]) -> None:
        self.pending.extend(vs)
        if len(self.pending) >= self.CHUNK:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.chunks.append(np.array(self.pending, dtype=self.dtype))
            self.pending = []

    def array(self, dtype: Any) -> np.ndarray:
        """All values as one array of ``dtype`` (the chunks freed as they are copied)."""
        self.flush()
        out = np.empty(sum(len(c) for c in self.chunks), dtype=dtype)
        at = 0
        while self.chunks:
            c = self.chunks.pop(0)
            out[at : at + len(c)] = c
            at += len(c)
        return out


def read_steps(path: str | Path, *, warn: Callable[[str], None] | None = None) -> StepLog:
    """Reads and validates a step file; raises StepLogError naming FILE:LINE: field on the first fault.

    A last line that no newline ends and that is not JSON (cut: the sidecar still writing it, or killed
    inside the write) is left out and said to ``warn`` (the log when None): it refused the whole file,
    every whole step with it, until a sidecar started on the file again and cut it.

    Memory is the returned columns (48 bytes a step, 25 a request row) plus 12 bytes a step and 3 a
    row while reading: every value is validated in range first, so the compact dtypes hold it exactly."""
    engines: dict[str, int] = {}  # one string per engine name, however many steps name it
    engine = _Column(np.int32)
    duration = _Column(np.float64)
    time_s = _Column(np.float64)
    batch = _Column(np.int32)  # 0..MAX_BATCH
    prefill = _Column(np.int32)  # 0..MAX_PREFILL_TOKENS
    kv = _Column(np.float64)  # NaN where a step has none (0..MAX_TOKENS is exact in a double)
    decoded = _Column(np.float64)
    rows = _Column(np.int32)  # request rows per step (<= batch)
    method = _Column(np.int8)
    k = _Column(np.int8)  # 0.._MAX_K
    acc = _Column(np.int8)
    nan = float("nan")
    read = 0  # steps read so far
    try:
        p = input_path(path)
        # The trace reader's bounded line reader and JSON loader (sizes, nesting, long integers).
        for ln, line in read_json_lines(p):
            try:
                d = load_json_line(line, source=str(p), line=ln)
            except TraceError:
                if line.endswith("\n"):
                    raise
                # No newline: the file's last line (read_json_lines refuses an over-long one), cut.
                (warn or log.warning)(
                    f"{p}:{ln}: a half-written last line (no newline ends it): left out, the "
                    f"{read} steps before it read"
                )
                break
            fields, codes, ks, a = parse_step(d, f"{p}:{ln}")
            read += 1
            engine.add(engines.setdefault(fields["engine"], len(engines)))
            duration.add(fields["duration_s"])
            time_s.add(fields["time_s"])
            batch.add(fields["batch"])
            prefill.add(fields["prefill_tokens"])
            kv.add(nan if fields["kv_tokens"] is None else fields["kv_tokens"])
            decoded.add(fields["decoded_tokens"])
            rows.add(len(codes))
            method.extend(codes)
            k.extend(ks)
            acc.extend(a)
    except TraceError as e:
        raise StepLogError(str(e)) from None
    names = list(engines)
    codes_ = engine.array(np.int32)
    if not len(codes_):
        raise StepLogError(f"{p}: no steps (an empty file)")
    per_step = rows.array(np.int64)
    kv_tokens = kv.array(np.float64)
    return StepLog(
        source=str(p),
        engine=tuple(names[c] for c in codes_.tolist()),
        duration_s=duration.array(np.float64),
        batch=batch.array(np.int64),
        prefill_tokens=prefill.array(np.int64),
        kv_tokens=None if np.isnan(kv_tokens).any() else kv_tokens,
        decoded_tokens=decoded.array(np.float64),
        time_s=time_s.array(np.float64),
        row_step=np.repeat(np.arange(len(per_step), dtype=np.int64), per_step),
        method=method.array(np.int8),
        k=k.array(np.int64),
        accepted=acc.array(np.int64),
    )


def write_steps(path: str | Path, records: Sequence[dict[str, Any]]) -> None:
    """Writes step records (``step_record`` layout) as a file (tests and benchmarks)."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
