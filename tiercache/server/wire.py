"""Byte-stream I/O for the protocol: a receive buffer and exact reads/writes over a socket.

Frames are read in two speeds. Headers and bodies (small) are read through an
:class:`Inbox`, a buffer that a ``recv`` fills with whatever has arrived, so
one system call usually brings a whole small message. Payloads (chunk values,
large) go straight into their destination (a host slot on the server, the
caller's view on the client) with ``recv_into``; only the few payload bytes
that arrived early in the inbox are copied. Writes use ``sendmsg`` with the
header, the body and every value as separate buffers (scatter-gather, no
concatenation copy).

:class:`AsyncStream` is the server's (a non-blocking socket on the asyncio
loop thread, one per connection task); :class:`SyncStream` is the client's (a
blocking socket with a timeout, used by one thread at a time). Neither keeps
a reference to a caller's buffer after the call that was given it returns.
Their TLS counterparts (same interface) are in :mod:`tiercache.server.tls_stream`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

from tiercache.server.protocol import Truncated

INBOX_BYTES = 256 * 1024
FIRST_INBOX_BYTES = 4096  # an inbox starts this small and grows to INBOX_BYTES at the first larger read
IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)
_Buffer = bytes | bytearray | memoryview


class Inbox:
    """Bytes received ahead of the reader: ``buf[start:end]`` is pending.

    The buffer starts at ``first`` bytes and grows to ``size`` once a read
    needs more (a connection that never sends a request costs 4 KiB, not 256).
    """

    def __init__(self, size: int = INBOX_BYTES, first: int = FIRST_INBOX_BYTES) -> None:
        self.size = size
        self.buf = bytearray(min(size, first))
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    @property
    def pending(self) -> int:
        return self.end - self.start

    def room_for(self, n: int) -> memoryview:
        """Where the next recv goes, with room for ``n`` pending bytes contiguous (n <= size)."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.start + n > len(self.buf):
            pending = self.end - self.start
            self.view[:pending] = self.view[self.start : self.end]
            self.start, self.end = 0, pending
        if n > len(self.buf):  # grow (once) to the full size
            grown = bytearray(self.size)
            grown[: self.end] = self.view[: self.end]
            self.buf, self.view = grown, memoryview(grown)
        return self.view[self.end :]

    def take(self, n: int) -> memoryview:
        """The next ``n`` pending bytes (valid until the next :meth:`room_for`)."""
        out = self.view[self.start : self.start + n]
        self.start += n
        return out

    def drain_into(self, dst: memoryview) -> int:
        """Copy pending bytes into the front of ``dst``; how many."""
        n = min(self.end - self.start, len(dst))
        if n:
            dst[:n] = self.view[self.start : self.start + n]
            self.start += n
        return n

    def skip(self, n: int) -> int:
        k = min(self.end - self.start, n)
        self.start += k
        return k


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """The buffers left after the first ``n`` bytes were sent."""
    i = 0
    while i < len(buffers) and n >= len(buffers[i]):
        n -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _drain(inbox: Inbox, views: Sequence[memoryview]) -> list[memoryview]:
    """Fill views from the inbox's pending bytes; the (parts of) views still to receive."""
    pending = _flat(views)
    while pending and inbox.pending:
        n = inbox.drain_into(pending[0])
        pending = _advance(pending, n)
    return pending


def _flat(buffers: Sequence[_Buffer]) -> list[memoryview]:
    out = []
    for b in buffers:
        v = b if isinstance(b, memoryview) else memoryview(b)
        if v.ndim != 1 or v.format != "B":
            v = v.cast("B")
        if len(v):
            out.append(v)
    return out


class AsyncStream:
    """One connection's socket on the event loop (server side). Counts bytes both ways."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = loop
        self.inbox = Inbox()
        self.bytes_in = 0
        self.bytes_out = 0

    async def _recv(self, view: memoryview) -> int:
        n = await self.loop.sock_recv_into(self.sock, view)
        if n == 0:
            raise Truncated("connection closed")
        self.bytes_in += n
        return n

    async def wait_readable(self) -> None:
        """Until at least one byte is pending (EOF raises Truncated)."""
        if not self.inbox.pending:
            n = await self._recv(self.inbox.room_for(1))  # room_for may move ``end``: call it first
            self.inbox.end += n

    async def read(self, n: int) -> memoryview | bytearray:
        """Exactly ``n`` bytes: a view into the inbox (until the next read) or a new buffer."""
        inbox = self.inbox
        if n > inbox.size:
            out = bytearray(n)
            await self.read_into(memoryview(out))
            return out
        while inbox.pending < n:
            got = await self._recv(inbox.room_for(n))  # room_for may move ``end``: call it first
            inbox.end += got
        return inbox.take(n)

    async def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` exactly: pending inbox bytes first, then straight from the socket."""
        got = self.inbox.drain_into(dst)
        while got < len(dst):
            got += await self._recv(dst[got:])

    async def read_into_many(self, views: Sequence[memoryview]) -> None:
        """Fill every view exactly, in order: one ``recvmsg_into`` scatters into many at once."""
        pending = _drain(self.inbox, views)
        while pending:
            try:
                n = self.sock.recvmsg_into(pending[:IOV_MAX])[0]
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            if n == 0:
                raise Truncated("connection closed")
            self.bytes_in += n
            pending = _advance(pending, n)

    async def _readable(self) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()
        self.loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self.loop.remove_reader(fd)

    async def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (the payload of a value that was refused)."""
        n -= self.inbox.skip(n)
        while n > 0:
            room = self.inbox.room_for(1)[: min(n, len(self.inbox.buf))]
            n -= await self._recv(room)

    async def send(self, buffers: Sequence[_Buffer]) -> None:
        """Send every buffer, in order (returns when the kernel has all of them)."""
        pending = _flat(buffers)
        while pending:
            batch = pending[:IOV_MAX]
            try:
                n = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            self.bytes_out += n
            pending = _advance(pending, n)

    async def _writable(self) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()
        self.loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self.loop.remove_writer(fd)

    async def drain_then_close(self, timeout_s: float, max_bytes: int) -> None:
        """Drop what the peer still sends until it closes (it does on our ERROR frame), ``timeout_s``
        passes or ``max_bytes`` arrived; then close. Closing a socket with unread bytes in it sends
        a reset, and a reset discards what the peer has not read yet: the replies to its requests
        before the refused one, already sent (a pipelining client loses them)."""
        dropped = 0
        deadline = self.loop.time() + timeout_s
        try:
            while dropped < max_bytes and (left := deadline - self.loop.time()) > 0:
                self.inbox.start = self.inbox.end = 0  # nothing in it is read any more
                dropped += await asyncio.wait_for(self._recv(self.inbox.room_for(1)), left)
        except (asyncio.TimeoutError, OSError, Truncated):
            pass
        finally:
            self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class SyncStream:
    """A blocking socket with a timeout (client side), used by one thread at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox = Inbox()

    def _recv(self, view: memoryview) -> int:
        n = self.sock.recv_into(view)
        if n == 0:
            raise Truncated("connection closed by the server")
        return n

    def has_pending(self) -> bool:
        """Whether received bytes wait to be read (the socket's readiness does not show them)."""
        return self.inbox.pending > 0

    def read(self, n: int) -> memoryview | bytearray:
        inbox = self.inbox
        if n > inbox.size:
            out = bytearray(n)
            self.read_into(memoryview(out))
            return out
        while inbox.pending < n:
            got = self._recv(inbox.room_for(n))  # room_for may move ``end``: call it first
            inbox.end += got
        return inbox.take(n)

    def read_into(self, dst: memoryview) -> None:
        got = self.inbox.drain_into(dst)
        while got < len(dst):
            got += self._recv(dst[got:])

    def read_into_many(self, views: Sequence[memoryview]) -> None:
        pending = _drain(self.inbox, views)
        while pending:
            n = self.sock.recvmsg_into(pending[:IOV_MAX])[0]
            if n == 0:
                raise Truncated("connection closed by the server")
            pending = _advance(pending, n)

    def skip(self, n: int) -> None:
        n -= self.inbox.skip(n)
        while n > 0:
            room = self.inbox.room_for(1)[: min(n, len(self.inbox.buf))]
            n -= self._recv(room)

    def send(self, buffers: Sequence[_Buffer]) -> None:
        pending = _flat(buffers)
        while pending:
            n = self.sock.sendmsg(pending[:IOV_MAX])
            pending = _advance(pending, n)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
