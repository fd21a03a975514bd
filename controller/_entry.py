"""``controllerctl``'s console-script entry point: loads the CLI under a Ctrl-C guard.

Importing :mod:`controller.cli` takes a noticeable fraction of a second (gRPC, protobuf, NumPy, the
simulator). A Ctrl-C in that window used to surface as Python's KeyboardInterrupt traceback; here it
ends like a press at any later moment: "interrupted" on stderr, exit 130, and a second press ends the
process at once. What must hold: this module imports nothing heavy itself (only ``os``, ``signal``
and ``sys``, which the interpreter has loaded already), so that its guard is in force from the first
line the console script runs.

gRPC's own log lines are off for every command but ``serve`` (unless ``GRPC_VERBOSITY`` says
otherwise): a client command's errors are one line of its own, and gRPC added one before it (``I1206
... ssl_transport_security.cc ... Handshake failed``, for ``--admin-ca-file`` against a plaintext
sidecar). gRPC reads the setting when it is imported, hence here, before anything imports it.
"""

from __future__ import annotations

import os
import signal
import sys

#: Exit status after Ctrl-C (128 + SIGINT), as :func:`controller.cli.main` returns it.
INTERRUPTED = 130


def main() -> int:
    if "serve" not in sys.argv[1:]:  # (a sidecar's operators keep gRPC's lines)
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        from controller.cli import main as cli_main
    except KeyboardInterrupt:
        # The CLI is not loaded, so nothing of it has to shut down: say so and go.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    return cli_main()
