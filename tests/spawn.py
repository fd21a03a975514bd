"""Children that start with a resource limit or a signal disposition of their own, without ``preexec_fn``.

Why: Python code run between fork and exec (``subprocess``'s ``preexec_fn``) in a process that holds
gRPC (every xdist worker, once a test has opened a channel) crashes some children before they exec:
SIGSEGV, or SIGABRT after "(event_engine) Epoll1Poller ... epoll_wait error: Bad file descriptor"
(gRPC's fork handlers). Beside a live gRPC server, 2-3 of 150 spawns with a no-op ``preexec_fn``
crashed, 0 of 150 without one; a clean-clone CI failed on it. What must hold: the child is a Python
prelude that sets the limit or disposition on itself and then execs the command, so it is the same
process (``Popen.pid``, process group) running the same argv, and the limit holds from its first
instruction.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence

_EXEC = "os.execvp(sys.argv[1], sys.argv[1:])"


def limited(argv: Sequence[str], *, limit: str, value: int) -> list[str]:
    """``argv`` under ``resource.<limit>`` set to ``value`` (soft and hard), e.g. ``RLIMIT_FSIZE``."""
    if not limit.startswith("RLIMIT_") or not hasattr(resource, limit):
        raise ValueError(f"limit: not a resource limit: {limit!r}")
    prelude = (
        f"import os, resource, sys; resource.setrlimit(resource.{limit}, ({value:d}, {value:d})); {_EXEC}"
    )
    return [sys.executable, "-c", prelude, *argv]


def default_signals(argv: Sequence[str]) -> list[str]:
    """``argv`` with SIGINT, SIGHUP and SIGTERM at their defaults: an ignored signal stays ignored
    across exec, and a pytest worker may ignore SIGINT, a run started under ``nohup`` SIGHUP (a
    clean-clone CI run so started failed both SIGHUP tests: the scripts never saw the signal)."""
    reset = "; ".join(f"signal.signal(signal.{s}, signal.SIG_DFL)" for s in ("SIGINT", "SIGHUP", "SIGTERM"))
    prelude = f"import os, signal, sys; {reset}; {_EXEC}"
    return [sys.executable, "-c", prelude, *argv]
