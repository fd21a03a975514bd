"""``controller._mqtt``'s event-loop handler: aiomqtt's watch of a broker socket that closed before the
loop ran it is one warning line, not a traceback; every other callback error still reaches the
default handler; a connection installs the handler only where the loop has none."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import pytest

from controller._mqtt import BrokerSettings, ConnectionLost, MqttConnection, _quiet_closed_socket


def _closed_fd() -> int:
    """A descriptor number that is not open (well above any this process holds)."""
    fd = 4000
    while True:
        try:
            os.fstat(fd)
        except OSError:
            return fd
        fd += 1


def test_a_watch_of_a_closed_socket_is_one_warning_and_other_errors_still_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def boom() -> None:
        raise RuntimeError("another callback's error")

    async def go() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_quiet_closed_socket)
        fd = _closed_fd()
        loop.call_soon(loop.add_writer, fd, lambda: None)  # as aiomqtt schedules it from paho's thread
        loop.call_soon(loop.add_reader, fd, lambda: None)
        loop.call_soon(boom)
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.WARNING):
        asyncio.run(go())
    quiet = [r for r in caplog.records if r.name == "controller.mqtt"]
    assert len(quiet) == 2 and all("closed before the event loop watched it" in r.getMessage() for r in quiet)
    loud = [r for r in caplog.records if r.name == "asyncio"]
    assert len(loud) == 1 and "boom" in loud[0].getMessage() and loud[0].exc_info is not None


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_connection_installs_the_handler_only_where_none_is_set() -> None:
    async def attempt(preset: object) -> object:
        loop = asyncio.get_running_loop()
        if preset is not None:
            loop.set_exception_handler(preset)  # type: ignore[arg-type]
        conn = MqttConnection(
            settings=BrokerSettings(port=_unused_port(), connect_timeout_s=1.0), client_id="test-handler"
        )
        with pytest.raises(ConnectionLost):  # nothing listens there: the handler is set before connecting
            await conn.__aenter__()
        return loop.get_exception_handler()

    assert asyncio.run(attempt(None)) is _quiet_closed_socket

    def mine(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        loop.default_exception_handler(context)

    assert asyncio.run(attempt(mine)) is mine
