"""``controllerctl trace record``: record a spectrace from a running vLLM OpenAI server.

Each prompt is sent to ``/v1/completions`` (greedy, the traffic class in ``vllm_xargs``); the server must
run with ``--per-request-spec-decode-metrics detailed`` so every response carries its per-step accepted
and drafted counts. Responses are kept as JSON Lines beside the trace (``<out>.responses.jsonl``) and
converted with the importer, so the K-censoring rules are the importer's (see ``sim/importer.py``):
counts are exact below the recorded K and censored at it; record at a fixed K > 0. Responses also carry
their token ids (``return_token_ids``), from which the importer computes each position's n-gram proposal
(``ngram_proposal``, with the plugin's n-gram sizes: pass the engine's ``SPECCONTROL_NGRAM_MIN/MAX``),
the signal the plugin reports per step.

Prompt file: JSON Lines of ``{"prompt": "...", "class": "code", "max_tokens": 256}`` (class, or
``traffic_class`` as the importer takes it, and max_tokens optional; a class is a non-empty string,
max_tokens in --max-tokens' range 2..2^22, both checked before any request is sent, as is
``--class``), or plain text with one prompt per line.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import math
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from policies.arms import Method
from policies.params import shown
from policies.prompt_lookup import DEFAULT_MAX_N, DEFAULT_MIN_N
from policies.text import error_text
from sim.files import output_problem
from sim.importer import import_vllm_metrics, response_problem
from sim.trace import (
    DEFAULT_LIMITS,
    MAX_OUTPUT_TOKENS,
    Trace,
    TraceError,
    _not_unicode,
    input_path,
    load_json_line,
    read_json_lines,
)

MAX_PROMPTS = 100_000
#: The largest answer read (bytes): what the importer reads as one line of the responses file; past it
#: the import refused the line anyway, after the recording.
MAX_RESPONSE_BYTES = DEFAULT_LIMITS.max_line_bytes - 4096
#: The longest a connection may take to open (s), within the request's own timeout: a host that drops
#: the packets (a firewall, a dead address) held every request for the whole timeout, 10 minutes by
#: default, so a prompt file against it failed only after days.
CONNECT_TIMEOUT_S = 30.0
#: Connections failed in a row (refused, unreachable, not opened in time; no answer in between, whatever
#: other failures there were: when a server dies, the requests it had queued end reset among the
#: refusals) after which the recording stops: the server is down. Before, a server that died partway had every
#: prompt left sent to it, each failing, and the run ended "done" (exit 0) on what came before.
STOP_AFTER_CONNECT_FAILURES = 8
#: Requests timed out in a row (no whole answer within ``--timeout``), each with nothing answered while
#: it waited, after which the recording stops the same way: a server that accepts connections but never
#: answers (hung, or a listener that is not one) held every prompt for the whole timeout, 10 minutes by
#: default, 32 at a time, so 500 prompts took hours to fail. (Counted in the order they ended, requests
#: in flight together that timed out together made a row after the answers others got meanwhile: a
#: server answering half its requests was stopped at 32 in flight.)
STOP_AFTER_TIMEOUTS = 8


class _ConnectFailed(OSError):
    """A request whose connection could not be opened (nothing was sent)."""


class _TimedOut(ValueError):
    """A request with no whole answer within its timeout."""


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    traffic_class: str
    max_tokens: int
    where: str = ""  # FILE:LINE of the prompt, which errors about its request name


def _class_problem(cls: Any) -> str | None:
    """Why ``cls`` cannot be a prompt's traffic class (None: it can): the importer takes a non-empty
    string of text, and refuses anything else only after every prompt was sent."""
    if isinstance(cls, str) and cls and _not_unicode(cls, "") is None:
        return None
    return f"expected a non-empty string, got {json.dumps(cls)}"


def read_prompts(path: str | Path, *, default_class: str, max_tokens: int) -> list[Prompt]:
    """Prompts from JSON Lines or plain text; errors name the file and line (``--class`` for the class
    of prompts without one: a byte of it that is not UTF-8 is a lone surrogate, no text)."""
    bad = _class_problem(default_class)
    if bad is not None:
        raise TraceError(bad, source="--class")
    p = input_path(path)
    out: list[Prompt] = []
    for lineno, raw in read_json_lines(p):
        line = raw.rstrip("\r\n")
        if lineno == 1:
            # A byte-order mark (Notepad, PowerShell) is no part of the text: a JSON first line was
            # taken for plain text, and the whole object sent as the prompt, its class dropped.
            line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
        if len(out) >= MAX_PROMPTS:
            raise TraceError(f"more than {MAX_PROMPTS} prompts", source=str(p), line=lineno)
        if line.lstrip().startswith("{"):
            obj = load_json_line(line, source=str(p), line=lineno)
            text = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise TraceError("expected a non-empty string", source=str(p), line=lineno, field="prompt")
            # ``traffic_class`` (what the request and the importer call it) or ``class``: the former was
            # ignored, every such prompt recorded as the default class. Both, they must agree.
            key = "traffic_class" if obj.get("traffic_class") is not None else "class"
            if key == "traffic_class" and obj.get("class") is not None and obj["class"] != obj[key]:
                raise TraceError(
                    f"{shown(obj['class'])}, but traffic_class is {shown(obj[key])}: give one of them",
                    source=str(p),
                    line=lineno,
                    field="class",
                )
            cls = obj.get(key, default_class)
            n = obj.get("max_tokens", max_tokens)
            # Refused here, before any request: the importer refuses an empty class only after every
            # prompt was sent, and a max_tokens past the flag's range is sent as is (a failed request).
            bad = _class_problem(cls)
            if bad is not None:
                raise TraceError(bad, source=str(p), line=lineno, field="class")
            if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= MAX_OUTPUT_TOKENS:
                raise TraceError(
                    f"expected an integer 2..{MAX_OUTPUT_TOKENS} (as --max-tokens), got {json.dumps(n)}",
                    source=str(p),
                    line=lineno,
                    field="max_tokens",
                )
            out.append(Prompt(text, cls, n, f"{p}:{lineno}"))
        else:
            out.append(Prompt(line, default_class, max_tokens, f"{p}:{lineno}"))
    if not out:
        raise TraceError("no prompts", source=str(p))
    return out


def url_problem(base_url: str) -> str | None:
    """What is wrong with ``--url`` before any request (None: nothing): a scheme other than http(s), no
    host or a port out of range failed every request one by one, as a runtime error (exit 1)."""
    try:
        u = urllib.parse.urlsplit(base_url)
        port = u.port
    except ValueError as e:  # an unclosed IPv6 bracket, a port that is not a number
        return f"--url {base_url}: not a URL ({e})"
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"--url {base_url}: expected http://HOST[:PORT] or https://HOST[:PORT] (the vLLM server)"
    if port == 0:
        return f"--url {base_url}: port 0 names no server"
    return None


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON: kept, they made the responses file unreadable to other JSON tools.
    raise ValueError(f"{name} (not a JSON number)")


def _read_body(resp: http.client.HTTPResponse, *, limit: int, deadline: float) -> bytes:
    """The whole body, refused past ``limit`` bytes or ``deadline`` (a monotonic time): an endless or
    huge answer held it all in memory (gigabytes)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise _TimedOut(f"no whole answer within the timeout ({size} bytes read)")
        chunk = resp.read1(1 << 16)
        if not chunk:
            # read1 ends quietly where read() raised: a body cut short of its Content-Length.
            if resp.length:
                raise http.client.IncompleteRead(b"".join(chunks), resp.length)
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise ValueError(f"the answer is over {limit} bytes (a response line's limit)")
        chunks.append(chunk)


class _Deadline:
    """One request's deadline over the whole exchange. urllib's timeout bounds each socket wait only:
    a server sending its status line and headers a byte at a time held a request with a 1 s timeout
    for 38 s. Each connection's socket is watched (a dup of it, which the TLS wrap and urllib's early
    close leave open) and shut down at the deadline, so a blocked read or send returns and the request
    fails; the connect itself gets the time left as its timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._expired = False
        self._stopped = False
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._expired = True
            if self._sock is not None:
                self._shut(self._sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):  # not connected (any more)
            sock.shutdown(socket.SHUT_RDWR)

    def _connect(
        self, address: tuple[str, int], timeout: Any = None, source_address: Any = None, *args: Any
    ) -> socket.socket:
        """``socket.create_connection`` within the time left, its socket watched (each connection of
        the request: a redirect opens another)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        try:
            sock = socket.create_connection(address, min(left, CONNECT_TIMEOUT_S), source_address, *args)
        except TimeoutError:
            if left <= CONNECT_TIMEOUT_S:  # the request's own deadline
                raise
            raise _ConnectFailed(f"no connection within {CONNECT_TIMEOUT_S:g} s") from None
        except OSError as e:  # refused, unreachable, a name that does not resolve: said as before
            failed = _ConnectFailed(e.errno, e.strerror) if e.errno is not None else _ConnectFailed(str(e))
            raise failed from e
        watched = sock.dup()
        with self._lock:
            old, self._sock = self._sock, watched
            if self._expired or self._stopped:
                self._shut(watched)
        if old is not None:
            old.close()
        return sock

    def connection(self, http_class: Any) -> Any:
        """A connection factory for ``AbstractHTTPHandler.do_open``: ``http_class``, connecting through
        ``_connect``."""

        def make(host: str, **kwargs: Any) -> http.client.HTTPConnection:
            conn: http.client.HTTPConnection = http_class(host, **kwargs)
            conn._create_connection = self._connect  # type: ignore[attr-defined]
            return conn

        return make

    def cut(self) -> None:
        """Ends the request now, as its deadline would (the recording was interrupted)."""
        self._timer.cancel()
        self._expire()

    def stop(self) -> bool:
        """Ends the watch (the timer's thread too, the watched dup closed); whether the deadline
        had cut the request. Idempotent."""
        self._timer.cancel()
        with self._lock:
            self._stopped = True
            sock, self._sock = self._sock, None
            expired = self._expired
        if sock is not None:
            sock.close()
        self._timer.join()
        return expired


class _InFlight:
    """The deadlines of the requests under way, so that an interrupted recording cuts them all at once
    (each waited out its own timeout, minutes, before the run could end), and refuses to start more;
    and the connections that could not be opened, and the requests that timed out with nothing
    answered while they waited, since the last answer, which cut it all at
    ``STOP_AFTER_CONNECT_FAILURES`` or ``STOP_AFTER_TIMEOUTS`` (``gone`` then says why). Counted by the requests' own threads as they fail: counted as the main thread
    takes the results, 32 threads had 123 more requests refused, microseconds each, before the stop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[_Deadline] = set()
        self._cut = False
        #: Failures of each kind since the last answer, and when that answer came (monotonic s).
        self._in_a_row = {"unopened": 0, "timed_out": 0}
        self._last_answer = -math.inf
        self.gone = ""

    def answered(self) -> None:
        with self._lock:
            self._in_a_row = dict.fromkeys(self._in_a_row, 0)
            self._last_answer = time.monotonic()

    def not_opened(self, error: str) -> None:
        """A request whose connection could not be opened, ``error`` why (naming the request)."""
        self._failed(
            "unopened", STOP_AFTER_CONNECT_FAILURES, "connections in a row could not be opened", error
        )

    def timed_out(self, error: str, *, sent_at: float) -> None:
        """A request sent at ``sent_at`` (monotonic s) with no whole answer within its timeout, ``error``
        why: counted only where nothing was answered while it waited."""
        self._failed("timed_out", STOP_AFTER_TIMEOUTS, "requests in a row timed out", error, sent_at=sent_at)

    def _failed(self, kind: str, limit: int, what: str, error: str, *, sent_at: float | None = None) -> None:
        with self._lock:
            # (cut requests fail as timed out or refused: they say nothing more of the server)
            if self._cut or (sent_at is not None and self._last_answer >= sent_at):
                return
            self._in_a_row[kind] += 1
            stop = self._in_a_row[kind] == limit
            if stop:
                self.gone = f"stopped after {limit} {what} (the last: {error})"
        if stop:
            self.cut_all()

    def add(self, deadline: _Deadline) -> None:
        with self._lock:
            self._live.add(deadline)
            cut = self._cut
        if cut:
            deadline.cut()

    def discard(self, deadline: _Deadline) -> None:
        with self._lock:
            self._live.discard(deadline)

    def cut_all(self) -> None:
        with self._lock:
            self._cut = True
            live = list(self._live)
        for d in live:
            d.cut()

    @property
    def cut(self) -> bool:
        return self._cut


class _Deadlined(urllib.request.AbstractHTTPHandler):
    """Opens its connections through ``_Deadline.connection`` (mixed into urllib's HTTP and HTTPS
    handlers, which are otherwise as they are)."""

    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def do_open(
        self, http_class: Any, req: urllib.request.Request, **kwargs: Any
    ) -> http.client.HTTPResponse:
        return super().do_open(self._deadline.connection(http_class), req, **kwargs)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Follows no redirect: urllib resends a POST redirected by 301, 302 or 303 as a GET without its
    body, and whatever answered that GET was recorded as the prompt's response. The 3xx is then an
    HTTPError like any other status, said with where it pointed."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class _DeadlineHTTPHandler(_Deadlined, urllib.request.HTTPHandler):
    pass


class _DeadlineHTTPSHandler(_Deadlined, urllib.request.HTTPSHandler):
    pass


def _exchange(req: urllib.request.Request, deadline: _Deadline, timeout_s: float, max_bytes: int) -> bytes:
    # urllib's default opener otherwise (proxies from the environment, HTTPError), with connections
    # bounded by ``deadline`` and no redirect followed.
    opener = urllib.request.build_opener(
        _DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline), _NoRedirect()
    )
    try:
        resp_cm = opener.open(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        # vLLM says why in the body ({"message": ...}); bounded, as any answer.
        with e:
            try:
                detail = e.read(400).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):
                detail = ""
        said = " ".join(detail.split())[:200]
        if 300 <= e.code < 400:
            to = " ".join(str(e.headers.get("Location", "nowhere")).split())[:200]
            said = f"redirected to {to}, not followed: give --url of the server itself"
        raise ValueError(f"HTTP {e.code} {e.reason}" + (f": {said}" if said else "")) from None
    with resp_cm as resp:
        ctype = resp.headers.get("Content-Type", "")
        if "text/event-stream" in ctype:  # a stream never ends by itself: not waited out
            raise ValueError("the server streamed (text/event-stream); expected one JSON answer")
        return _read_body(resp, limit=max_bytes, deadline=deadline.deadline)


def _post(
    url: str,
    body: dict[str, Any],
    timeout_s: float,
    *,
    max_bytes: int = MAX_RESPONSE_BYTES,
    in_flight: _InFlight | None = None,
) -> dict[str, Any]:
    """POST ``body`` as JSON; the answer's JSON object. ``timeout_s`` bounds the whole request (connect,
    send, status line, headers and body); ``in_flight`` may cut it sooner (then it fails as timed out)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    deadline = _Deadline(timeout_s)
    if in_flight is not None:
        in_flight.add(deadline)
    timed_out = False
    data = b""
    try:
        data = _exchange(req, deadline, timeout_s, max_bytes)
    except (OSError, http.client.HTTPException, ValueError):
        # Cut at the deadline, http.client says whatever the shut socket made of it (a bad status line,
        # a short body, a reset): the timeout is why.
        timed_out = deadline.stop() or time.monotonic() >= deadline.deadline
        if not timed_out:
            raise
    finally:
        timed_out = deadline.stop() or timed_out  # (a body cut at the deadline may end quietly)
        if in_flight is not None:
            in_flight.discard(deadline)
    if timed_out:
        raise _TimedOut(f"no whole answer within the timeout ({timeout_s:g} s)")
    try:
        obj = json.loads(data, parse_constant=_reject_constant)
    except RecursionError:  # a hostile or broken server: an error like any unreadable answer
        raise ValueError("the server answered with JSON nested too deeply to read") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not JSON: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg}: byte {e.pos} of {len(data)})") from None
    except ValueError as e:  # NaN, or an integer past Python's digit limit
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("the server answered with something other than a JSON object")
    return obj


def _copy_in_order(f: IO[bytes], where: list[tuple[int, int, int]], to: Path) -> None:
    """The lines of ``f`` at ``where`` ((prompt index, offset, bytes) each) written to ``to`` in prompt
    order, one line in memory at a time."""
    with to.open("wb") as out:
        for _, offset, size in sorted(where):
            f.seek(offset)
            out.write(f.read(size))


def record(
    *,
    base_url: str,
    model: str,
    prompts: list[Prompt],
    responses_path: Path,
    concurrency: int = 4,
    timeout_s: float = 600.0,
    on_done: Callable[[int], None] | None = None,
    errors: list[str] | None = None,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
    max_line_bytes: int = DEFAULT_LIMITS.max_line_bytes,
    other_models: list[tuple[int, str]] | None = None,
    stopped: list[str] | None = None,
) -> int:
    """Send every prompt; write each response (plus class and send time) as a JSON line. Returns failures
    (``errors``, when given, gets each failed request's error, naming its prompt).

    The lines go to ``<responses>.partial`` as the answers come, and ``responses_path`` gets them in
    prompt order once every request is done (that file renamed, or its lines copied in order to
    ``<responses>.ordering``, renamed): a run cut short (Ctrl-C, a full disk) leaves no file that reads
    as a whole recording, and a run whose every request failed leaves none. Cut short, it sends no more
    prompts and cuts the requests under way before it re-raises. Memory holds no answer
    past its writing, whatever the order they finish in. A file that cannot be written raises TraceError naming it.
    A response whose line would be over ``max_line_bytes`` (the importer's limit), or that the import
    would refuse (``response_problem``: usage, spec metrics, token ids), is a failed request.
    ``other_models``, when given, gets (prompt index, model) of each recorded answer that names a
    model other than ``model``, in prompt order. After ``STOP_AFTER_CONNECT_FAILURES`` requests whose
    connection could not be opened, or ``STOP_AFTER_TIMEOUTS`` that timed out, with no answer in
    between, no more prompts are sent and the requests under way are cut (they count as failed);
    ``stopped``, when given, gets why."""
    url = base_url.rstrip("/") + "/v1/completions"
    start = time.monotonic()
    in_flight = _InFlight()

    def one(i_p: tuple[int, Prompt]) -> dict[str, Any] | None:
        i, p = i_p
        if in_flight.cut:  # interrupted: a worker taking up its next prompt sends nothing
            return None
        sent_at = time.monotonic()
        sent = sent_at - start
        body = {
            "model": model,
            "prompt": p.text,
            "max_tokens": p.max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "vllm_xargs": {"traffic_class": p.traffic_class},
        }
        request = f"POST {url} for prompt {p.where or i + 1}"
        try:
            obj = _post(url, body, timeout_s, max_bytes=max_response_bytes, in_flight=in_flight)
        except (urllib.error.URLError, OSError, ValueError) as e:
            timed_out = isinstance(e, _TimedOut)
            if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
                e = _TimedOut(f"no whole answer within the timeout ({timeout_s:g} s)")  # str(): "timed out"
                timed_out = True
            error = f"{error_text(e)} ({request})"
            if isinstance(e, _ConnectFailed) or isinstance(getattr(e, "reason", None), _ConnectFailed):
                in_flight.not_opened(error)
            elif timed_out:
                in_flight.timed_out(error, sent_at=sent_at)
            return {"error": error, "index": i}
        except http.client.HTTPException as e:
            # urllib passes a non-HTTP answer (BadStatusLine: a wrong port) or a cut body (IncompleteRead)
            # through unwrapped; like any failed request it is counted, not a traceback. Its str() alone
            # is the bytes received, so the kind is said too.
            return {
                "error": f"not a whole HTTP answer ({type(e).__name__}: {e!s:.200}) ({request})",
                "index": i,
            }
        in_flight.answered()  # the server is there, whatever the answer says
        # Checked as the import will check it: one answer it refuses failed the whole recording, after
        # every request, naming a line of the responses file rather than the request.
        problem = response_problem(obj)
        if problem is not None:
            return {"error": f"{problem} ({request})", "index": i}
        obj["traffic_class"] = p.traffic_class
        obj["arrival_s"] = round(sent, 6)
        obj["id"] = f"r{i}"
        return obj

    partial = responses_path.with_name(responses_path.name + ".partial")
    ordering = responses_path.with_name(responses_path.name + ".ordering")
    # Each answer is written as it comes (to ``partial``, in the order they finish) and only where its
    # line starts is kept; the file is put in prompt order at the end. Taken in prompt order
    # (``pool.map``), every answer that finished behind a slow one was held in memory until it was
    # done: one long request held all the others' token ids, gigabytes over a long recording.
    where: list[tuple[int, int, int]] = []  # (prompt index, offset in ``partial``, bytes) of each line
    others: list[tuple[int, str]] = []  # (prompt index, model) of answers naming another model
    failed: list[tuple[int, str]] = []
    not_sent = 0
    try:
        responses_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with partial.open("w+b") as f, _pool(concurrency, in_flight) as pool:
                pending = {pool.submit(one, ip): ip[0] for ip in enumerate(prompts)}
                for done, fut in enumerate(as_completed(pending), start=1):
                    i = pending.pop(fut)  # (as_completed lets go of it too: its answer is freed)
                    obj = fut.result()
                    del fut
                    line = None if obj is None or "error" in obj else json.dumps(obj) + "\n"
                    if line is not None and len(line) > max_line_bytes:
                        # Written again as JSON, an answer grows (\uXXXX escapes for non-ASCII text, a
                        # space after every comma): a line past the importer's limit failed the import
                        # of every response, after the whole recording. (ASCII: characters are bytes.)
                        obj = {
                            "error": f"the response is {len(line)} bytes as a line of {responses_path}, "
                            f"over the importer's limit of {max_line_bytes} (POST {url} for prompt "
                            f"{prompts[i].where or i + 1})"
                        }
                        line = None
                    if line is None:
                        failed.append((i, str(obj["error"]) if obj is not None else "not sent: stopped"))
                        not_sent += obj is None
                    else:
                        assert obj is not None
                        named = obj.get("model")
                        if isinstance(named, str) and named != model:
                            others.append((i, named))
                        data = line.encode("utf-8")
                        where.append((i, f.tell(), len(data)))
                        f.write(data)
                    del obj, line
                    if on_done is not None:
                        on_done(done)
                in_order = all(a[0] < b[0] for a, b in itertools.pairwise(where))
                if not in_order:
                    _copy_in_order(f, where, ordering)
            if where:
                (partial if in_order else ordering).replace(responses_path)
        finally:
            partial.unlink(missing_ok=True)  # (gone already when renamed)
            ordering.unlink(missing_ok=True)
    except OSError as e:
        raise TraceError(
            f"cannot write the responses: {error_text(e)}", source=str(e.filename or partial)
        ) from None
    failures = len(failed)
    if in_flight.gone and stopped is not None:
        stopped.append(f"{in_flight.gone}; {not_sent} of {len(prompts)} prompts not sent")
    if other_models is not None:
        other_models.extend(sorted(others))
    if errors is not None:
        errors.extend(msg for _, msg in sorted(failed))  # in prompt order: the first is the first prompt's
    return failures


@contextlib.contextmanager
def _pool(workers: int, in_flight: _InFlight) -> Iterator[ThreadPoolExecutor]:
    """A thread pool that, left by an exception (Ctrl-C, a failed write), sends nothing more: the
    prompts not yet sent are dropped and the requests under way cut. Left as ``with ThreadPoolExecutor``
    leaves it, its shutdown waited for every queued prompt to be sent and answered: Ctrl-C stopped the
    progress bar while the recording went on unseen to the end of the prompt file."""
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        yield pool
    except BaseException:
        in_flight.cut_all()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


class RecordUsageError(ValueError):
    """A mistake in the command line found before any request (exit 2, where a failed recording is 1)."""


def responses_file(out: Path) -> Path:
    """The responses kept beside the trace ``out``: ``<out>.responses.jsonl``."""
    return out.with_name(out.name.removesuffix(".gz").removesuffix(".jsonl") + ".responses.jsonl")


def record_trace(
    *,
    base_url: str,
    model: str,
    prompts: list[Prompt],
    out: Path,
    method: Method,
    concurrency: int = 4,
    on_done: Callable[[int], None] | None = None,
    ngram: tuple[int, int] = (DEFAULT_MIN_N, DEFAULT_MAX_N),
    warn: Callable[[str], None] | None = None,
    timeout_s: float = 600.0,
    stopped: list[str] | None = None,
) -> tuple[Trace, int, Path]:
    """Record responses and convert them; returns the trace, the failed requests and the responses file.
    ``ngram``: the (min_n, max_n) of the n-gram proposals computed from the responses' token ids;
    ``warn``: gets the import's warnings and the first failed request's error (default: stderr);
    ``timeout_s``: the longest one request may take, its whole answer read; ``stopped``: gets why the
    recording stopped before the last prompt, when the server could no longer be reached (``record``),
    the trace then holding what was answered before.

    Raises RecordUsageError before any request for a bad ``base_url`` or a responses file that cannot
    be one (a directory, a device), TraceError when every request failed or a response is refused."""
    problem = url_problem(base_url)
    if problem is not None:
        raise RecordUsageError(problem)
    responses = responses_file(out)
    # The responses file is an output too: a directory of its name failed only after the recording.
    problem = output_problem("--out", responses)
    if problem is not None:
        raise RecordUsageError(f"{problem} (the responses kept beside the trace)")
    errors: list[str] = []
    other_models: list[tuple[int, str]] = []
    stop: list[str] = []
    failures = record(
        base_url=base_url,
        model=model,
        prompts=prompts,
        responses_path=responses,
        concurrency=concurrency,
        timeout_s=timeout_s,
        on_done=on_done,
        errors=errors,
        other_models=other_models,
        stopped=stop,
    )
    if prompts and failures == len(prompts):  # (the import would say only "no responses found")
        if stop:
            raise TraceError(f"no request was answered: {stop[0]}", source=base_url)
        raise TraceError(f"every request failed ({failures}); the first: {errors[0]}", source=base_url)
    if stopped is not None:
        stopped.extend(stop)
    if failures:  # counted in the summary; why is said once, not lost
        (warn or _say)(f"{base_url}: {failures} of {len(prompts)} requests failed; the first: {errors[0]}")
    if other_models:
        # Said, not refused: vLLM answers with its first served name whichever alias was asked for
        # (--served-model-name a b), and a router may name the model it routed to. Said, the trace
        # is known to hold that model's acceptance (a proxy's other model, or a mix of models).
        i, named = other_models[0]
        names = sorted({m for _, m in other_models})
        (warn or _say)(
            f"{base_url}: {len(other_models)} of {len(prompts) - failures} responses name the model "
            f"{shown(named)}, not --model {shown(model)}"
            + (f" ({len(names)} models: {', '.join(shown(m) for m in names[:5])})" if len(names) > 1 else "")
            + f", the first for prompt {prompts[i].where or i + 1}: the trace holds the acceptance of the "
            f"model that answered (an alias of the served name, or a router's pick)"
        )
    trace = import_vllm_metrics(responses, method=method, ngram=ngram, greedy=True, warn=warn)
    return trace, failures, responses


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)
