"""How a benchmark script ends on Ctrl-C: "interrupted" on stderr and exit 130, as ``controllerctl`` does.

Every ``benchmarks/*.py`` script runs its ``main`` through :func:`run_main` (imported in its ``if
__name__ == "__main__"`` block only: when a script is run, benchmarks/ is ``sys.path[0]``; a script
imported as a module, by a test or by ``plugin_ab.py``'s child, never runs it; ``sim_vs_engine``
imports :func:`die_with_parent` at the top, and the tests that import it put benchmarks/ on the path). What must hold: the
script's own ``finally`` blocks have run (its sidecars, engines and process pools stopped, its
temporary directories removed) before "interrupted" is printed, no ``--json`` file is written by an
interrupted run (they are written once, at the end), and a second Ctrl-C during that shutdown ends
the process at once. A script whose SIGINT is ignored (a background job) is left so. SIGTERM and SIGHUP
(``timeout``, a closed terminal, a job cancelled) end it the same way: killed at once, a script left its
sidecar or engine running for good. :func:`die_with_parent` covers a script killed outright (SIGKILL).
"""

from __future__ import annotations

import signal
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn

#: Exit status after Ctrl-C (128 + SIGINT).
INTERRUPTED = 130


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def die_with_parent() -> None:
    """Have this process get SIGTERM when the process that started it dies, however it dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing): for a child a script stops in its ``finally`` blocks, which a
    SIGKILL skips. Call it in the child (``preexec_fn=``, or first thing in a multiprocessing target)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())``, with Ctrl-C (and SIGTERM, SIGHUP) ending it as "interrupted", exit 130 (no
    traceback), once its ``finally`` blocks have run."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:  # (nohup's ignored SIGHUP stays ignored)
            signal.signal(sig, _terminated)
    try:
        code = main()
    except KeyboardInterrupt:
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
