"""``controllerctl``'s console-script entry point: loads the CLI under a Ctrl-C guard.

Importing :mod:`controller.cli` takes a noticeable fraction of a second (gRPC, protobuf, NumPy, the
simulator). A Ctrl-C in that window used to surface as Python's KeyboardInterrupt traceback; here it
ends like a press at any later moment: "interrupted" on stderr, exit 130, and a second press ends the
process at once. What must hold: this module imports nothing heavy itself (only ``signal`` and
``sys``, which the interpreter has loaded already), so that its guard is in force from the first
line the console script runs.
"""

from __future__ import annotations

import signal
import sys

#: Exit status after Ctrl-C (128 + SIGINT), as :func:`controller.cli.main` returns it.
INTERRUPTED = 130


def main() -> int:
    try:
        from controller.cli import main as cli_main
    except KeyboardInterrupt:
        # The CLI is not loaded, so nothing of it has to shut down: say so and go.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    return cli_main()
