"""A TCP proxy for fault tests: one link between two services (router -> engine, scheduler
-> cell) that the test delays, black-holes or resets while traffic flows.

    proxy = await LinkProxy("127.0.0.1:5001").start()   # clients dial proxy.target
    proxy.delay_s = 0.05     # every chunk, each way, waits this long (order kept)
    proxy.blackhole()        # bytes are swallowed, connections stay open (a partition)
    proxy.heal()             # bytes flow again (what was swallowed is gone)
    proxy.reset()            # every open connection is reset (RST), new ones are taken
    await proxy.stop()

TLS passes through untouched (the proxy sees only bytes), so the services keep their mTLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class LinkProxy:
    """Forwards connections from a loopback port to ``upstream`` (host:port)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.delay_s = 0.0
        self.black = False
        self.target = ""
        self.resets = 0
        self._server: asyncio.AbstractServer | None = None
        self._live: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    async def start(self) -> LinkProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.target = f"127.0.0.1:{port}"
        return self

    def blackhole(self) -> None:
        self.black = True

    def heal(self) -> None:
        self.black = False

    def reset(self) -> None:
        """Resets every open connection, both ends (SO_LINGER 0: an RST, not a FIN)."""
        for pair in list(self._live):
            for writer in pair:
                _abort(writer)
            self._live.discard(pair)
            self.resets += 1

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset()
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            _abort(client_w)
            return
        pair = (client_w, up_w)
        self._live.add(pair)
        try:
            await asyncio.gather(self._pump(client_r, up_w), self._pump(up_r, client_w))
        finally:
            self._live.discard(pair)
            for writer in pair:
                _abort(writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if self.black:
                    continue  # swallowed: the peer hears nothing, the connection stays up
                writer.write(data)
                await writer.drain()
        _abort(writer)  # one side ended or failed: end the other too


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
