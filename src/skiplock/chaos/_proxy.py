"""A small asyncio TCP proxy that can drop, stall and reset the connections through it.

Workers connect to the proxy instead of Postgres, so the network can fail under them
in the ways a real one does: a connection closed by a middlebox (drop), reset (an RST
from a restarted load balancer), or silent for a while (stall: bytes are held, then
delivered).  ``swallow`` goes further: requests still reach the server but its replies
are discarded until the connection is reset, which is how a write that committed can
look failed to its client.  ``refuse`` turns new connections away.  For a unix-socket
DSN (the embedded server) the proxy listens on 127.0.0.1 and forwards to the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["ChaosProxy", "proxied_dsn", "upstream_of"]

T = TypeVar("T")
_CHUNK = 65536


def upstream_of(dsn: str) -> tuple[str, int] | str:
    """Where ``dsn`` connects: (host, port) for TCP, the socket path for a unix socket."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "/var/run/postgresql").split(",")[0]
    port = int(str(params.get("port") or 5432).split(",")[0])
    if host.startswith("/"):
        return str(Path(host) / f".s.PGSQL.{port}")
    return (host, port)


def proxied_dsn(dsn: str, port: int) -> str:
    """``dsn`` pointed at the proxy on 127.0.0.1:``port``; everything else unchanged."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params.pop("hostaddr", None)
    params.update(host="127.0.0.1", port=str(port))
    return make_conninfo("", **params)


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    swallowing: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class ChaosProxy:
    """Forward 127.0.0.1:<port> to ``upstream``; the fault methods are thread-safe."""

    def __init__(self, upstream: tuple[str, int] | str) -> None:
        self.upstream = upstream
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._links: set[_Link] = set()
        self._stall_until = 0.0
        self._refuse_until = 0.0
        self.accepted = 0

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> int:
        self._thread.start()
        self._server = self._call(self._listen())
        return self.port

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._close_all(), timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> ChaosProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connections(self) -> int:
        return len(self._links)

    # -- faults --------------------------------------------------------------------------

    def reset(self, fraction: float = 1.0) -> int:
        """Abort a random ``fraction`` of the connections with an RST; returns how many."""
        return self._call(self._cut(fraction, rst=True))

    def drop(self, fraction: float = 1.0) -> int:
        """Close a random ``fraction`` of the connections cleanly (FIN) on both sides."""
        return self._call(self._cut(fraction, rst=False))

    def stall(self, seconds: float) -> int:
        """Hold every byte in both directions for ``seconds``, then deliver it."""
        self._stall_until = time.monotonic() + seconds
        return self.connections

    def refuse(self, seconds: float) -> None:
        """Close new connections at once for ``seconds`` (the server seems down)."""
        self._refuse_until = time.monotonic() + seconds

    def swallow(self) -> int:
        """Discard the server's replies on every open connection until it is reset.

        Requests sent meanwhile still run and commit; their clients hear nothing.  The
        caller resets the connections once it has seen (in the database) what it wanted
        to commit unseen.
        """
        return self._call(self._swallow())

    # -- internals -----------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _listen(self) -> asyncio.base_events.Server:
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._refuse_until:
            _abort(writer)
            return
        try:
            if isinstance(self.upstream, str):
                up_reader, up_writer = await asyncio.open_unix_connection(self.upstream)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _abort(writer)
            return
        self.accepted += 1
        link = _Link(writer, up_writer)
        self._links.add(link)
        link.tasks = [
            asyncio.ensure_future(self._pump(reader, up_writer, link, to_client=False)),
            asyncio.ensure_future(self._pump(up_reader, writer, link, to_client=True)),
        ]

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        to_client: bool,
    ) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                while (wait := self._stall_until - time.monotonic()) > 0:
                    await asyncio.sleep(min(wait, 0.05))
                if to_client and link.swallowing:
                    continue
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._finish(link, rst=False)

    def _finish(self, link: _Link, *, rst: bool) -> None:
        if link not in self._links:
            return
        self._links.discard(link)
        for w in (link.client, link.server):
            if rst:
                _abort(w)
            else:
                with contextlib.suppress(Exception):
                    w.close()
        for t in link.tasks:
            t.cancel()

    async def _cut(self, fraction: float, *, rst: bool) -> int:
        links = [lk for lk in list(self._links) if random.random() < fraction]
        for lk in links:
            self._finish(lk, rst=rst)
        return len(links)

    async def _swallow(self) -> int:
        for lk in self._links:
            lk.swallowing = True
        return len(self._links)

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut(1.0, rst=True)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST where the socket is TCP (SO_LINGER 0), else just close."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()
