"""A blocking client connection to the cache server: one socket, requests answered in order.

Used by the client tier (:mod:`tiercache.backends.server.backend`, one connection per
I/O thread), by ``tiercache inspect`` and ``tiercache bench server``, and by
the tests. Each call sends one request and reads its reply. PUT and GET can
also be pipelined: :meth:`ServerClient.send_put` / :meth:`ServerClient.send_get`
send a request and return a :class:`Pending` at once, and
:meth:`ServerClient.finish` reads its reply later; the server answers a
connection's requests in the order sent, so replies are read oldest first
(each checked against its request id), and the caller decides how many are in
flight (a GET's request is small and a PUT's reply is small, so neither side
blocks the other's sends). With a TLS
context (:func:`tiercache.server.tls.client_context`) the connection is TLS,
the server's certificate and name verified before HELLO is sent. PUT values are
sent straight from the caller's buffers (``sendmsg``, no concatenation) and
GET values are received straight into the caller's views (handed on piece by
piece as they arrive with ``on_data``: :meth:`ServerClient.finish`); a view a
failed request may have written into is zeroed before the error propagates. A value
may be given as a tuple of pieces (the client tier's frame header, then the
chunk's view): a PUT sends them as one value, a GET scatters the value over
them in order. Over NIXL (PUT_REMOTE/GET_REMOTE) a value's head may travel
in the request or reply body and only the rest by NIXL.

Errors: ``OSError`` (the network, timeouts), :class:`~tiercache.server.protocol.ProtocolError`
(a reply this side cannot trust) and :class:`~tiercache.server.protocol.RemoteError`
(the server refused the request) all leave the connection closed; call
:meth:`ServerClient.connect` again. Not thread-safe: one thread at a time.
"""

from __future__ import annotations

import itertools
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from tiercache.server import protocol as p
from tiercache.server.client_values import OnData, receive_values
from tiercache.server.tls_stream import TlsSyncStream
from tiercache.server.wire import SyncStream

if TYPE_CHECKING:
    from typing_extensions import Self

R = TypeVar("R", bound=p._Body)
_Buffer = bytes | bytearray | memoryview
#: One value: a buffer, or a tuple of pieces that make one value together.
_Value = _Buffer | tuple[_Buffer, ...]

_PROGRESS_EVERY_S = 0.001
#: What a client accepts in replies (the server's own limits are in Welcome).
CLIENT_LIMITS = p.Limits(
    max_body_bytes=64 << 20, max_payload_bytes=1 << 40, max_keys=p.MAX_KEYS_CAP,
    max_key_bytes=p.MAX_KEY_BYTES_CAP, max_value_bytes=1 << 40,
)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"server address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass(eq=False, slots=True)
class Pending:
    """A PUT or GET sent on a connection whose reply is not read yet.

    ``views``: a GET's destination pieces per key (written only by
    :meth:`ServerClient.finish`); empty for a PUT. Belongs to the client
    connection that sent it: a reconnect or any error drops every pending request.
    """

    msg_type: p.MsgType
    request_id: int
    keys: int
    views: list[list[memoryview]] = field(default_factory=list)


class ServerClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        client_name: str = "",
        timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        nixl_metadata: bytes = b"",
        nixl_agent: str = "",
        nixl_progress: Callable[[], None] | None = None,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        self.address = parse_address(address)
        self.tls = tls  # None: plaintext TCP
        self.server_name = server_name or self.address[0]  # what the server's certificate must name
        self.token = token or ""
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.nixl_metadata = nixl_metadata
        self.nixl_agent = nixl_agent
        # Called in a loop while a NIXL request waits for its reply (the agent has no thread).
        self.nixl_progress = nixl_progress
        self.welcome: p.Welcome | None = None
        self._stream: SyncStream | None = None
        self._ids = itertools.count(1)
        self._pending: deque[Pending] = deque()  # sent, reply not read yet, oldest first

    # ------------------------------------------------------------------ connection
    @property
    def connected(self) -> bool:
        return self._stream is not None

    def closed_by_server(self) -> bool:
        """Between requests: the server has ended this connection (idle timeout, drain, a refusal).

        A connection at rest has nothing to read; anything readable (EOF or an
        unasked ERROR frame) means the server is done with it. Checked without
        blocking before a request is sent, so an idle-closed connection is
        replaced instead of failing that request.
        """
        stream = self._stream
        if stream is None:
            return True
        if self._pending:  # not at rest: what is readable may be a reply
            return False
        if stream.has_pending():
            return True
        try:  # poll, not select: a process may hold more than FD_SETSIZE sockets
            poller = select.poll()
            poller.register(stream.sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def connect(self) -> p.Welcome:
        self.close()
        sock = socket.create_connection(self.address, timeout=self.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:  # the handshake runs under the connect timeout
                tls_sock = self.tls.wrap_socket(sock, server_hostname=self.server_name)
            except BaseException:
                sock.close()
                raise
            tls_sock.settimeout(self.timeout_s)
            self._stream = TlsSyncStream(tls_sock)
        else:
            sock.settimeout(self.timeout_s)
            self._stream = SyncStream(sock)
        hello = p.Hello(
            token=self.token, client=self.client_name[: p.MAX_TEXT],
            nixl_agent=self.nixl_agent, nixl_metadata=self.nixl_metadata,
        )
        self.welcome = self._call(p.MsgType.HELLO, hello, p.Welcome)
        return self.welcome

    @property
    def in_flight(self) -> int:
        """Requests sent whose replies are not read yet."""
        return len(self._pending)

    def close(self) -> None:
        self._pending.clear()
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __enter__(self) -> Self:
        if not self.connected:
            self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._call(p.MsgType.EXISTS, p.Exists(list(keys)), p.ExistsReply).present

    def put(self, keys: Sequence[bytes], values: Sequence[_Value], overwrite: bool = False) -> list[p.Status]:
        """Store ``values[i]`` under ``keys[i]``; a status per key (PRESENT: held already and
        kept, unless ``overwrite``)."""
        statuses, _ = self.finish(self.send_put(keys, values, overwrite))
        return statuses

    def send_put(self, keys: Sequence[bytes], values: Sequence[_Value], overwrite: bool = False) -> Pending:
        """Send a PUT without waiting for its reply (:meth:`finish` reads it). The values are
        sent before this returns: the caller may reuse their buffers at once."""
        pieces = [_pieces(v) for v in values]
        body = p.Put(list(keys), [sum(map(len, v)) for v in pieces], overwrite)
        return self._send(p.MsgType.PUT, body, len(keys), payload=[x for v in pieces for x in v])

    def put_remote(
        self, keys: Sequence[bytes], sizes: Sequence[int], addrs: Sequence[int], overwrite: bool = False,
        heads: Sequence[bytes] = (),
    ) -> list[p.Status]:
        """The server READs value ``i`` from ``addrs[i]``; with ``heads``, value ``i`` is
        ``heads[i]`` (sent in the body) then ``sizes[i] - len(heads[i])`` bytes READ from ``addrs[i]``."""
        body = p.PutRemote(list(keys), list(sizes), list(addrs), overwrite, [bytes(h) for h in heads])
        return _statuses(self._call(p.MsgType.PUT_REMOTE, body, p.PutReply, spin=True).status, len(keys))

    def get(self, keys: Sequence[bytes], views: Sequence[_Value],
            on_data: OnData | None = None) -> tuple[list[p.Status], list[int]]:
        """Read each key into ``views[i]`` (its first ``sizes[i]`` bytes); statuses and sizes
        (``on_data``: as :meth:`finish`)."""
        return self.finish(self.send_get(keys, views), on_data)

    def send_get(self, keys: Sequence[bytes], views: Sequence[_Value]) -> Pending:
        """Send a GET without waiting; :meth:`finish` receives the values into ``views``
        (which the caller must leave alone until then)."""
        pieces = [_pieces(v) for v in views]
        body = p.Get(list(keys), [sum(map(len, v)) for v in pieces])
        return self._send(p.MsgType.GET, body, len(keys), views=pieces)

    def finish(self, pending: Pending, on_data: OnData | None = None) -> tuple[list[p.Status], list[int]]:
        """Read the reply of ``pending``, the oldest request in flight: its statuses, and for a
        GET the value sizes (a PUT's sizes are empty), the values received into its views.

        ``on_data(ranges, statuses, sizes)`` (a GET's): called as soon as about
        :data:`~tiercache.server.client_values.VALUE_GROUP_BYTES` more have arrived, ``ranges`` naming them as ``(key index,
        start, end)`` byte ranges of the values: in order, each OK value's ranges covering it
        exactly once from byte 0 (a large value in several calls), keys without a value never
        named. So the caller checks bytes still in the CPU's cache instead of all of them
        after the last. An exception it raises is an error like any other.

        Any error closes the connection (every other pending request is lost with it); a
        GET's views it may have written into are zeroed first.
        """
        if not self._pending or self._pending[0] is not pending or self._stream is None:
            self.close()
            raise ConnectionError("not the oldest request in flight on this connection")
        self._pending.popleft()
        written: list[memoryview] = []
        try:
            stream = self._stream
            if pending.msg_type is p.MsgType.PUT:
                reply = self._finish(p.MsgType.PUT, stream, p.PutReply, False, pending.request_id)
                return _statuses(reply.status, pending.keys), []
            got = self._finish(p.MsgType.GET, stream, p.GetReply, True, pending.request_id)
            statuses = _statuses(got.status, pending.keys)
            if len(got.sizes) != pending.keys:
                raise p.MalformedBody("GET reply sizes do not match the keys")
            expected = sum(size for status, size in zip(statuses, got.sizes) if status is p.Status.OK)
            if expected != self._payload_len:
                raise p.MalformedBody(f"GET reply carries {self._payload_len} bytes, sizes say {expected}")
            sizes = list(got.sizes)
            for value, status, size in zip(pending.views, statuses, sizes):
                if status is p.Status.OK and size > sum(map(len, value)):
                    raise p.MalformedBody(f"a value of {size} bytes for a view of {sum(map(len, value))}")
            # straight into the caller's views, scattered; with on_data a group at a time
            receive_values(stream, pending.views, statuses, sizes, on_data, written)
            return statuses, sizes
        except BaseException:
            for view in written:
                view[:] = bytes(len(view))
            self.close()
            raise

    def get_remote(
        self, keys: Sequence[bytes], capacities: Sequence[int], addrs: Sequence[int]
    ) -> tuple[list[p.Status], list[int]]:
        """The server WRITEs each OK value whole to ``addrs[i]``; statuses and sizes."""
        statuses, sizes, _ = self.get_remote_heads(keys, capacities, addrs)
        return statuses, sizes

    def get_remote_heads(
        self, keys: Sequence[bytes], capacities: Sequence[int], addrs: Sequence[int],
        head_lens: Sequence[int] = (),
    ) -> tuple[list[p.Status], list[int], list[bytes]]:
        """Statuses, sizes and heads: with ``head_lens``, each OK value's first ``min(head_lens[i],
        size)`` bytes come back in the reply (checked here) and only the rest is written to ``addrs[i]``;
        without, heads are empty and whole values are written."""
        body = p.GetRemote(list(keys), list(capacities), list(addrs), list(head_lens))
        reply = self._call(p.MsgType.GET_REMOTE, body, p.GetReply, spin=True)
        statuses = _statuses(reply.status, len(keys))
        if len(reply.sizes) != len(keys):
            self.close()
            raise p.MalformedBody("GET_REMOTE reply sizes do not match the keys")
        heads = list(reply.heads) if head_lens else [b""] * len(keys)
        expected = [min(n, size) if status is p.Status.OK else 0
                    for n, size, status in zip(head_lens or [0] * len(keys), reply.sizes, statuses)]
        if len(heads) != len(keys) or [len(h) for h in heads] != expected:
            self.close()
            raise p.MalformedBody("GET_REMOTE reply heads do not match the values")
        return statuses, list(reply.sizes), heads

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._call(p.MsgType.DELETE, p.Delete(list(keys)), p.DeleteReply).deleted

    def stats(self) -> p.StatsReply:
        return self._call(p.MsgType.STATS, p.Stats(), p.StatsReply)

    def health(self) -> p.HealthReply:
        return self._call(p.MsgType.HEALTH, p.Health(), p.HealthReply)

    def agent_meta(self, metadata: bytes) -> None:
        self._call(p.MsgType.AGENT_META, p.AgentMeta(metadata), p.Ack)

    # ------------------------------------------------------------------ framing
    def _call(self, msg_type: p.MsgType, body: p._Body, reply_cls: type[R], spin: bool = False) -> R:
        """One request and its reply, nothing else in flight."""
        try:
            if self._pending:
                raise ConnectionError(f"{len(self._pending)} pipelined requests still in flight")
            stream, request_id = self._begin(msg_type, body)
            if spin and self.nixl_progress is not None:
                self._progress_until_readable(stream)
            reply = self._finish(msg_type, stream, reply_cls, False, request_id)
        except BaseException:
            self.close()
            raise
        return reply

    def _send(self, msg_type: p.MsgType, body: p._Body, keys: int, payload: Sequence[memoryview] = (),
              views: list[list[memoryview]] | None = None) -> Pending:
        try:
            _, request_id = self._begin(msg_type, body, payload)
        except BaseException:
            self.close()
            raise
        pending = Pending(msg_type, request_id, keys, views or [])
        self._pending.append(pending)
        return pending

    def _progress_until_readable(self, stream: SyncStream) -> None:
        """Drive the NIXL agent until the reply starts arriving (bounded by the timeout)."""
        assert self.nixl_progress is not None
        deadline = time.monotonic() + self.timeout_s
        sock = stream.sock
        while not stream.has_pending():
            self.nixl_progress()
            # Sleep in select (GIL released, no spinning against the server's transfer on a busy
            # host): the reply wakes it at once; the agent needs only occasional progress.
            if select.select([sock], [], [], _PROGRESS_EVERY_S)[0]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply within {self.timeout_s}s")

    def _begin(self, msg_type: p.MsgType, body: p._Body,
               payload: Sequence[memoryview] = ()) -> tuple[SyncStream, int]:
        if self._stream is None:
            raise ConnectionError("not connected")
        request_id = next(self._ids) & 0xFFFFFFFF
        if request_id == 0:  # wrapped: 0 names the connection in an ERROR, never a request
            request_id = next(self._ids) & 0xFFFFFFFF
        size = sum(len(v) for v in payload)
        self._stream.send([p.frame(msg_type, request_id, body, size), *payload])
        return self._stream, request_id

    def _finish(self, msg_type: p.MsgType, stream: SyncStream, reply_cls: type[R], payload_ok: bool,
                request_id: int) -> R:
        header = p.unpack_header(stream.read(p.HEADER_BYTES), CLIENT_LIMITS, replies=True)
        connection_error = header.type == p.MsgType.ERROR and header.request_id == 0
        if header.request_id != request_id and not connection_error:
            raise p.ProtocolError(f"reply to request {header.request_id}, expected {request_id}")
        body_bytes = stream.read(header.body_len)
        if header.type == p.MsgType.ERROR:
            error = p.decode_body(p.ErrorReply, body_bytes)
            raise p.RemoteError(error.code, error.message)
        if header.type != p.reply_type(msg_type):
            raise p.UnknownMessageType(f"reply type {header.type:#x} to a {msg_type.name}")
        if header.payload_len and not payload_ok:
            raise p.UnexpectedPayload("unexpected payload in a reply")
        self._payload_len = header.payload_len
        return p.decode_body(reply_cls, body_bytes)


def _pieces(value: _Value) -> list[memoryview]:
    """A value's pieces as flat byte views."""
    views = [memoryview(x) for x in (value if isinstance(value, tuple) else (value,))]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]


def _statuses(raw: list[int], n: int) -> list[p.Status]:
    if len(raw) != n:
        raise p.MalformedBody(f"{len(raw)} statuses for {n} keys")
    try:
        return [p.Status(s) for s in raw]
    except ValueError as exc:
        raise p.MalformedBody(str(exc)) from None
