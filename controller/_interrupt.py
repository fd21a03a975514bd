"""Ctrl-C for the commands that run an event loop (``controllerctl demo``, ``controllerctl observe``).

The first press cancels the command's main task, so that it shuts down in order (its ``finally``
blocks, its gRPC calls and channels), and gives SIGINT back its default action: a second press ends
the process at once. Never a KeyboardInterrupt raised in whatever frame the loop was running, which
is what ``asyncio.run``'s own handler does on a second press (or on any press once its main task is
done): raised inside gRPC's request-iterator task it was printed as "Task exception was never
retrieved ... KeyboardInterrupt"; raised in asyncio's shutdown it crashed it with a traceback (exit 1),
or left a task half shut down that the shutdown then waited on for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def interruptible(coro: Awaitable[T]) -> T:
    """Await ``coro`` in the current task, which the first Ctrl-C cancels (CancelledError comes out)."""
    task = asyncio.current_task()
    assert task is not None
    pressed = False

    def first_press() -> None:
        nonlocal pressed
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if not pressed:  # (two presses can be queued before the first one is handled: cancel once)
            pressed = True
            task.cancel()

    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # no signal handlers off the main thread
        loop.add_signal_handler(signal.SIGINT, first_press)
    try:
        return await coro
    finally:
        if pressed:
            _keep_default_action(loop)


def _keep_default_action(loop: asyncio.AbstractEventLoop) -> None:
    """Take ``first_press`` off ``loop`` with SIGINT left at its default action. Left to the loop, its
    close put Python's own handler back (``remove_signal_handler`` installs ``default_int_handler``), so
    a later press of a burst raised KeyboardInterrupt in whatever the shutdown ran (a traceback in
    signal.py on a loaded machine). Here too that handler is in place for a moment: a press landing in
    it ends the process as any press after the first does."""
    try:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)`` under :func:`interruptible`; Ctrl-C raises KeyboardInterrupt once ``coro``
    has shut down."""
    main = interruptible(coro)
    try:
        return asyncio.run(main)
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    finally:
        # A press before the main task's first step (before the loop ran, or asyncio.run's handler
        # cancelling the task then) left these never started: closed, they say nothing ("coroutine
        # ... was never awaited" on stderr). A no-op for a coroutine that ran.
        main.close()
        coro.close()
