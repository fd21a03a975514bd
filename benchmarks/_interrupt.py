"""How a benchmark script ends on Ctrl-C: "interrupted" on stderr and exit 130, as ``controllerctl`` does.

Every ``benchmarks/*.py`` script runs its ``main`` through :func:`run_main` (imported in its ``if
__name__ == "__main__"`` block only: when a script is run, benchmarks/ is ``sys.path[0]``; a script
imported as a module, by a test or by ``plugin_ab.py``'s child, never runs it; ``sim_vs_engine``
imports :func:`dying_with_parent` at the top, and the tests that import it put benchmarks/ on the
path). What must hold: the
script's own ``finally`` blocks have run (its sidecars, engines and process pools stopped, its
temporary directories removed) before "interrupted" is printed, no ``--json`` file is written by an
interrupted run (they are written once, at the end), and a second Ctrl-C during that shutdown ends
the process at once. A script whose SIGINT is ignored (a background job) is left so. SIGTERM and SIGHUP
(``timeout``, a closed terminal, a job cancelled) end it the same way: killed at once, a script left its
sidecar or engine running for good. :func:`die_with_parent` (in a child: :func:`dying_with_parent`)
covers a script killed outright (SIGKILL).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn

#: Exit status after Ctrl-C (128 + SIGINT).
INTERRUPTED = 130


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM, SIGHUP: the KeyboardInterrupt of a Ctrl-C. Where an event loop runs, raised from a
    callback of the loop's own (out of ``asyncio.run``, whose clean-up then cancels every task and runs
    their ``finally`` blocks): raised at whatever line the main thread was on, it landed inside gRPC's
    request-stream task, whose bare ``except:`` swallowed it (the RPC cancelled, the script waiting on
    for good; seen with sidecar_load, 1 of ~20 SIGTERMs under load)."""
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt from None
    loop.call_soon_threadsafe(_raise_interrupt)


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


def die_with_parent() -> None:
    """Have this process get SIGTERM when the process that started it dies, however it dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing): for a child a script stops in its ``finally`` blocks, which a
    SIGKILL skips. Call it first thing in a multiprocessing target; a subprocess gets it from
    ``dying_with_parent``."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


#: The child's first instructions (``dying_with_parent``): the parent-death signal, kept across exec;
#: a parent already gone by then (its pid, passed first, no longer the parent) ends it at once.
_PDEATHSIG_THEN_EXEC = (
    "import os, sys\n"
    "from _interrupt import die_with_parent\n"
    "die_with_parent()\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` as a child that gets SIGTERM when this process dies (``die_with_parent``, set in the
    child itself, which then execs ``argv``: the same process). Not ``preexec_fn=die_with_parent``:
    Python code between fork and exec in a process holding gRPC crashed 1-2 % of children (gRPC's
    fork handlers: SIGSEGV, or SIGABRT on "epoll_wait error: Bad file descriptor")."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r})\n" + _PDEATHSIG_THEN_EXEC
    return [sys.executable, "-c", code, str(os.getpid()), *argv]


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())``, with Ctrl-C (and SIGTERM, SIGHUP) ending it as "interrupted", exit 130 (no
    traceback), once its ``finally`` blocks have run."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:  # (nohup's ignored SIGHUP stays ignored)
            signal.signal(sig, _terminated)
    from asyncio import CancelledError

    try:
        code = main()
    # asyncio.run cancels its main task on Ctrl-C and then raises KeyboardInterrupt, unless the task
    # was cancelled more than once by then (a timeout inside it firing in the same moment): then the
    # CancelledError itself came out, a traceback (sidecar_load, kill -INT). Nothing else cancels a
    # script's main task: either way the run was interrupted.
    except (KeyboardInterrupt, CancelledError):
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second press ends the process at once
        # Nothing after the word: a signal landing while asyncio.run built its loop left a half-made
        # loop, whose __del__ at exit printed a traceback ("Exception ignored in ... BaseEventLoop.
        # __del__", and "coroutine ... was never awaited") below "interrupted" (seen with sidecar_load
        # and SIGHUP). What the interpreter finds to complain of while it shuts down is not the user's.
        sys.unraisablehook = lambda unraisable: None
        warnings.simplefilter("ignore")
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    sys.exit(code)
