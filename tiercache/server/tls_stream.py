"""TLS byte streams with the same interface as :mod:`tiercache.server.wire`'s plaintext ones.

:class:`TlsStream` is the server's (a non-blocking :class:`ssl.SSLSocket` on
the asyncio loop thread, one per connection task); :class:`TlsSyncStream` the
client's (a blocking SSLSocket with a timeout). They subclass
:class:`~tiercache.server.wire.AsyncStream` / :class:`~tiercache.server.wire.SyncStream`
and replace only what TLS cannot do: ``recvmsg_into``/``sendmsg`` (an SSL
socket reads and writes one buffer at a time: scattered reads become one read
per view, small buffers of a send are joined into one record), and the
readiness waits (data already decrypted inside the SSL object does not make
the file descriptor readable, so every read first *tries* and waits for the
descriptor only on ``SSLWantRead``/``SSLWantWrite``). Payloads still go
straight into their destination views (``recv_into``); only the small
buffers of a send are joined.

Server handshake: lazily, on the connection's first read or write, so the
connection's HELLO timeout bounds it too. Before handshaking, the first bytes
are peeked: a client that speaks the plaintext protocol (the frame magic)
gets one plaintext ERROR frame (``tls_required``) and is closed, anything
else that is not a TLS record is closed; a failed handshake (untrusted or
missing client certificate, wrong protocol) is logged and closes the
connection. Nothing is read or written as application data before the
handshake completed.

:func:`open_stream` picks the server's stream for a connection (plaintext
when the server has no TLS context). Buffer ownership is as in
:mod:`tiercache.server.wire`: nothing keeps a caller's buffer after the call.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Sequence

from tiercache.server import protocol as p
from tiercache.server.wire import AsyncStream, SyncStream, _Buffer, _drain, _flat

logger = logging.getLogger(__name__)

_TLS_HANDSHAKE_RECORD = 0x16
_JOIN_BELOW = 16 * 1024  # buffers smaller than this are joined into one write (one TLS record)
_JOIN_MAX = 64 * 1024


def open_stream(sock: socket.socket, loop: asyncio.AbstractEventLoop,
                context: ssl.SSLContext | None) -> AsyncStream:
    """The server's stream for an accepted socket: TLS when the server has a context."""
    if context is None:
        return AsyncStream(sock, loop)
    return TlsStream(sock, loop, context)


def _joined(views: list[memoryview]) -> list[_Buffer]:
    """``views`` with runs of small buffers joined (fewer, fuller TLS records)."""
    out: list[_Buffer] = []
    run: list[memoryview] = []
    size = 0
    for view in views:
        if len(view) < _JOIN_BELOW and size + len(view) <= _JOIN_MAX:
            run.append(view)
            size += len(view)
            continue
        if run:
            out.append(b"".join(run) if len(run) > 1 else run[0])
            run, size = [], 0
        if len(view) < _JOIN_BELOW:
            run, size = [view], len(view)
        else:
            out.append(view)
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out


class TlsStream(AsyncStream):
    """One TLS connection on the event loop (server side); same interface as AsyncStream."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, context: ssl.SSLContext) -> None:
        super().__init__(sock, loop)
        self._context = context
        self._state = "new"  # new -> handshaking -> open | failed
        try:
            host, port = sock.getpeername()[:2]
            self._peer = f"{host}:{port}"
        except OSError:
            self._peer = "?"

    async def _ready(self) -> None:
        """Handshake once (first call); raise if an earlier handshake did not complete."""
        if self._state == "open":
            return
        if self._state != "new":
            raise ConnectionAbortedError("the TLS handshake did not complete")
        self._state = "handshaking"
        try:
            await self._refuse_plaintext()
            tls = self._context.wrap_socket(self.sock, server_side=True, do_handshake_on_connect=False)
            self.sock = tls
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._readable()
                except ssl.SSLWantWriteError:
                    await self._writable()
        except ssl.SSLError as exc:
            self._state = "failed"
            logger.info("TLS handshake with %s failed: %s", self._peer, exc.reason or exc)
            raise
        except BaseException:
            self._state = "failed"
            raise
        self._state = "open"

    async def _refuse_plaintext(self) -> None:
        """Peek at the first byte: a TLS record goes on; a plaintext client is told and closed."""
        while True:
            try:
                head = self.sock.recv(len(p.MAGIC), socket.MSG_PEEK)
                break
            except (BlockingIOError, InterruptedError):
                await self._readable()
        if not head:
            raise p.Truncated("connection closed")
        if head[0] == _TLS_HANDSHAKE_RECORD:
            return
        if p.MAGIC.startswith(head):  # our protocol in plaintext: say why, in plaintext
            error = p.ErrorReply(code="tls_required", message="this server accepts TLS connections only")
            try:
                self.sock.recv(1 << 16)  # what arrived (a HELLO): closing with it unread would reset
                self.sock.send(p.frame(p.MsgType.ERROR, 0, error))
            except OSError:
                pass
        logger.info("connection %s: not a TLS client; closed", self._peer)
        raise ConnectionAbortedError("not a TLS client")

    async def _recv(self, view: memoryview) -> int:
        await self._ready()
        while True:
            try:
                n = self.sock.recv_into(view)
                break
            except ssl.SSLWantReadError:
                await self._readable()
            except ssl.SSLWantWriteError:
                await self._writable()
        if n == 0:
            raise p.Truncated("connection closed")
        self.bytes_in += n
        return n

    async def read_into_many(self, views: Sequence[memoryview]) -> None:
        """Fill every view exactly, in order (one read at a time: TLS has no scattered read)."""
        for view in _drain(self.inbox, views):
            got = 0
            while got < len(view):
                got += await self._recv(view[got:])

    async def send(self, buffers: Sequence[_Buffer]) -> None:
        await self._ready()
        for chunk in _joined(_flat(buffers)):
            data = memoryview(chunk)
            while data:
                try:
                    n = self.sock.send(data)
                except ssl.SSLWantWriteError:
                    await self._writable()
                    continue
                except ssl.SSLWantReadError:
                    await self._readable()
                    continue
                self.bytes_out += n
                data = data[n:]


class TlsSyncStream(SyncStream):
    """A blocking TLS socket with a timeout (client side); same interface as SyncStream."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        super().__init__(sock)
        self.tls_sock = sock

    def has_pending(self) -> bool:
        return self.inbox.pending > 0 or self.tls_sock.pending() > 0

    def read_into_many(self, views: Sequence[memoryview]) -> None:
        for view in _drain(self.inbox, views):
            got = 0
            while got < len(view):
                got += self._recv(view[got:])

    def send(self, buffers: Sequence[_Buffer]) -> None:
        for chunk in _joined(_flat(buffers)):
            self.tls_sock.sendall(chunk)
