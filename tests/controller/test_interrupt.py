"""controller._interrupt: after the first Ctrl-C, SIGINT keeps its default action until the process ends.

What must hold: once the first press has cancelled the command's task, a later press ends the process
(SIGINT's default action) wherever it lands, also after the event loop closed; Python's own handler
(KeyboardInterrupt raised in whatever frame runs) never comes back. Run in a child process: the test
changes what SIGINT does there.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal
    from controller import _interrupt

    async def command():
        os.kill(os.getpid(), signal.SIGINT)  # the first press, while the command runs
        await asyncio.sleep(30)

    try:
        _interrupt.run(command())
    except KeyboardInterrupt:
        pass
    handler = signal.getsignal(signal.SIGINT)
    print("default action" if handler is signal.SIG_DFL else f"handler {handler!r}")
    """
)


def test_after_the_first_press_sigint_keeps_its_default_action_past_the_loops_close() -> None:
    # The loop's close put Python's default_int_handler back (remove_signal_handler does): a second
    # press of a burst then raised KeyboardInterrupt in the shutdown, a traceback on stderr.
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "default action", out.stdout
