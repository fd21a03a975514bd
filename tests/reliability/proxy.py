"""A TCP proxy on loopback whose connections a test can cut mid-stream (a real socket disconnect) or
freeze (a peer that vanished without a reset: bytes go nowhere, the sockets stay open)."""

from __future__ import annotations

import asyncio
import contextlib


class CuttableProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (``host:port``); ``cut()`` aborts every connection,
    ``freeze()`` makes every open one a black hole (new connections forward as before)."""

    def __init__(self, *, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.cuts = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._frozen: set[asyncio.StreamWriter] = set()  # writers whose data is now discarded

    @property
    def target(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()

    def cut(self) -> int:
        """Abort every open connection (RST, no goodbye); returns how many were cut."""
        n = 0
        for w in list(self._writers):
            w.transport.abort()
            n += 1
        self._writers.clear()
        self.cuts += 1
        return n

    def freeze(self) -> int:
        """Stop forwarding on every open connection, both ways, without closing it (a partitioned
        network): each side's writes vanish, nothing is read back, no FIN or RST. How many."""
        frozen = set(self._writers) - self._frozen
        self._frozen |= frozen
        return len(frozen) // 2

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_w}
        pumps = [
            asyncio.create_task(self._pump(reader, up_w, self._frozen)),
            asyncio.create_task(self._pump(up_r, writer, self._frozen)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in pumps:
                t.cancel()
                self._tasks.discard(t)
            for w in (writer, up_w):
                w.transport.abort()
                self._writers.discard(w)
                self._frozen.discard(w)

    @staticmethod
    async def _pump(
        src: asyncio.StreamReader, dst: asyncio.StreamWriter, frozen: set[asyncio.StreamWriter]
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                if dst in frozen:
                    continue  # read and dropped: the sender sees its bytes leave, nothing arrives
                dst.write(data)
                await dst.drain()
