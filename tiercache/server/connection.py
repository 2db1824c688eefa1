"""One client connection on the server: HELLO, then requests served one at a time, in order.

Each connection is one asyncio task on the server's event loop. It reads a
frame header, bounds-checks it (:func:`~tiercache.server.protocol.unpack_header`
against the server's limits), reads and decodes the body, applies the
configured limits, serves the request against the shared
:class:`~tiercache.server.store.ChunkStore`, and writes the reply before it
reads the next header. Anything refused (bad magic, version, type, flags, an
oversized or malformed message, a wrong token, a request before HELLO) is
answered with one ERROR frame naming the reason and the connection is closed:
its framing can no longer be trusted. Before closing an authenticated
connection, the server reads and drops what the client still sends for up to a
second (or 16 MiB), so that the replies to requests it pipelined before the
refused one are not lost to a TCP reset. Other connections never notice: nothing
a connection reads is shared, and the store is only changed through its
two-phase put/get calls, whose failure paths undo what they reserved.

A PUT's values are received straight into the host slots the store reserved
(STORING); a disconnect or a cancellation before the last byte frees them
(``end_put(ok=False)``). A GET's values are sent straight from pinned slots.
With NIXL, PUT_REMOTE/GET_REMOTE move the values with one transfer per
request and only the reply (and each value's head, when the client asks)
travels on the socket (:mod:`tiercache.server.nixl_requests`).

Bounds: each request runs under the connection's :class:`~tiercache.server.deadlines.FrameClock`
(receive and send deadlines: a stalled client is cut off and its slots freed)
and charges its keys to the store's budgets (:mod:`tiercache.server.budgets`:
past the connection's or its tenant's share a key is LIMIT).

The connection sees its server only through :class:`ConnectionHost` (what it
reads of the server, and the two calls it makes back), so this module does not
import :mod:`tiercache.server.service`; the service's
:class:`~tiercache.server.service.CacheServer` is the one implementation.

Threading: event loop thread only. Buffers: the connection's inbox is its own;
slot views are used only between the store's begin and end calls.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tiercache.server import nixl_requests
from tiercache.server import protocol as p
from tiercache.server.budgets import Charge
from tiercache.server.deadlines import FrameClock, ReplyTimeout
from tiercache.server.nixl_owners import AgentRefused
from tiercache.server.tenants import Tenant, limits_for, scope_request
from tiercache.server.tls_stream import open_stream

if TYPE_CHECKING:
    import ssl

    from tiercache.server.auth import TokenTable
    from tiercache.server.config import ServerConfig
    from tiercache.server.metrics import ServerMetrics
    from tiercache.server.nixl_owners import AgentOwners
    from tiercache.server.nixl_path import NixlEndpoint
    from tiercache.server.store import ChunkStore

logger = logging.getLogger(__name__)

# After an ERROR frame: how long, and how many bytes, the server reads and drops what the client
# still sends (requests it pipelined behind the refused one) before it closes the connection.
_DRAIN_S = 1.0
_DRAIN_BYTES = 16 << 20


class ConnectionHost(Protocol):
    """What a :class:`Connection` needs of its server (event loop thread only)."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def limits(self) -> p.Limits: ...
    @property
    def store(self) -> ChunkStore: ...
    @property
    def metrics(self) -> ServerMetrics: ...
    @property
    def nixl(self) -> NixlEndpoint | None: ...
    @property
    def draining(self) -> bool: ...
    @property
    def uptime_s(self) -> float: ...
    @property
    def connections(self) -> Collection[Connection]: ...
    @property
    def tokens(self) -> TokenTable: ...
    @property
    def agents(self) -> AgentOwners: ...
    @property
    def tls(self) -> ssl.SSLContext | None: ...

    def forget(self, conn: Connection) -> None:
        """The connection has closed: drop it from the server's set."""

    def stats_reply(self, tenant: Tenant | None) -> p.StatsReply:
        """The body of a STATS reply as ``tenant`` may see it (tiercache/server/tenant_stats.py)."""

    def connection_count(self, tenant: Tenant | None) -> int:
        """How many connections ``tenant`` may know of (HEALTH)."""


@dataclass
class ConnectionStats:
    session: int
    peer: str
    client: str = ""
    data_path: str = "tcp"
    started: float = field(default_factory=time.monotonic)
    requests: int = 0
    put_keys: int = 0
    get_keys: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0

    def as_struct(self, bytes_in: int, bytes_out: int) -> p.ClientStats:
        return p.ClientStats(
            session=self.session, client=self.client, peer=self.peer, data_path=self.data_path,
            connected_s=round(time.monotonic() - self.started, 3), requests=self.requests,
            put_keys=self.put_keys, get_keys=self.get_keys, hits=self.hits, misses=self.misses,
            bytes_in=bytes_in, bytes_out=bytes_out, errors=self.errors,
        )


class Connection:
    def __init__(self, server: ConnectionHost, sock: socket.socket, peer: str, session: int) -> None:
        self.server = server
        self.store = server.store
        self.limits = server.limits
        self.stream = open_stream(sock, asyncio.get_running_loop(), server.tls)
        self.tenant: Tenant | None = None  # set once HELLO's token named one; fixed after
        self.stats = ConnectionStats(session, peer)
        self.busy = False  # between reading a request's header and writing its reply
        self.task: asyncio.Task[None] | None = None
        self.clock = FrameClock(server.config.frame_timeout_s, server.config.min_transfer_rate)
        self._nixl_peer: str | None = None
        self._request_id = 0
        self._handlers: dict[p.MsgType, Callable[[p.Header, Any], Any]] = {
            p.MsgType.EXISTS: self._exists,
            p.MsgType.PUT: self._put,
            p.MsgType.GET: self._get,
            p.MsgType.DELETE: self._delete,
            p.MsgType.STATS: self._stats,
            p.MsgType.HEALTH: self._health,
            p.MsgType.PUT_REMOTE: self._put_remote,
            p.MsgType.GET_REMOTE: self._get_remote,
            p.MsgType.AGENT_META: self._agent_meta,
        }

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        try:
            await asyncio.wait_for(self._hello(), self.server.config.hello_timeout_s)
            while not self.server.draining:
                idle = self.server.config.idle_timeout_s
                if idle is None:
                    await self.stream.wait_readable()
                else:
                    await asyncio.wait_for(self.stream.wait_readable(), idle)
                self.busy = True
                async with self.clock.request():  # receive and send deadlines (deadlines.py)
                    header, body = await self._read_request(hello=False)
                    self.clock.received(header)
                    started = time.perf_counter()
                    await self._handlers[p.MsgType(header.type)](header, body)
                name = p.MsgType(header.type).name.lower()
                self.server.metrics.requests.labels(name).inc()
                self.server.metrics.request_seconds.labels(name).observe(time.perf_counter() - started)
                self.stats.requests += 1
                self.busy = False
        except p.Truncated:
            if self.busy:  # the stream ended inside a frame
                self.server.metrics.refused.labels(p.Truncated.code).inc()
        except ReplyTimeout as exc:  # a reply half sent: no ERROR frame after it
            self.server.metrics.refused.labels(exc.code).inc()
            logger.info("connection %s closed: %s", self.stats.peer, exc)
        except p.ProtocolError as exc:
            await self._refuse(exc)
        except asyncio.TimeoutError:
            await self._refuse(p.ProtocolError("timed out"), code="timeout")
        except (ConnectionError, OSError) as exc:
            logger.debug("connection %s: %s", self.stats.peer, exc)
        except asyncio.CancelledError:
            pass  # drain: an idle connection, or one that did not finish in time
        except Exception:
            logger.exception("connection %s: request failed", self.stats.peer)
            await self._refuse(p.ProtocolError("internal error"), code="internal")
        finally:
            self._close()

    async def _read_request(self, hello: bool) -> tuple[p.Header, Any]:
        self._request_id = 0  # until this request's header is known good
        header = p.unpack_header(await self.stream.read(p.HEADER_BYTES), self.limits, replies=False)
        self._request_id = header.request_id
        if hello != (header.type == p.MsgType.HELLO):
            if hello:
                raise p.HelloRequired("the first message must be HELLO")
            raise p.UnknownMessageType("HELLO was already accepted")
        body = p.decode_body(p.body_type(header), await self.stream.read(header.body_len))
        p.check_request(body, header, self.limits)
        body = scope_request(self.tenant, body)  # every key into the tenant's space
        return header, body

    async def _hello(self) -> None:
        header, hello = await self._read_request(hello=True)
        self.tenant = self.server.tokens.authenticate(hello.token)
        self.limits = limits_for(self.limits, self.tenant)  # keys shorter by the tenant's prefix
        self.stats.client = hello.client
        nixl = self.server.nixl
        if hello.nixl_metadata and nixl is not None:
            try:
                self._nixl_peer = await self.server.agents.add(nixl, self.tenant.name, hello.nixl_metadata)
                self.stats.data_path = "nixl"
            except AgentRefused as exc:
                logger.warning("client %s: NIXL metadata refused (%s); TCP only", hello.client, exc)
            except Exception:
                logger.warning("client %s: cannot load its NIXL metadata; TCP only", hello.client, exc_info=True)
        welcome = p.Welcome(
            server=self.server.config.name, session=self.stats.session,
            max_body_bytes=self.limits.max_body_bytes, max_payload_bytes=self.limits.max_payload_bytes,
            max_keys=self.limits.max_keys, max_key_bytes=self.limits.max_key_bytes,
            max_value_bytes=self.limits.max_value_bytes, nixl=self._nixl_peer is not None,
        )
        await self._reply(p.MsgType.HELLO, header.request_id, welcome)

    async def _reply(self, msg_type: p.MsgType, request_id: int, body: p._Body, payload: list[memoryview] | None = None) -> None:
        size = sum(len(v) for v in payload) if payload else 0
        self.clock.sending(size)
        await self.stream.send([p.frame(p.reply_type(msg_type), request_id, body, size), *(payload or ())])

    async def _refuse(self, exc: p.ProtocolError, code: str | None = None) -> None:
        """Answer with one ERROR frame (echoing the request's id when its header was readable)."""
        code = code or exc.code
        self.stats.errors += 1
        self.server.metrics.refused.labels(code).inc()
        logger.info("connection %s refused: %s: %s", self.stats.peer, code, exc)
        data = p.frame(p.MsgType.ERROR, self._request_id, p.ErrorReply(code=code, message=str(exc)[:4000]))
        try:
            await asyncio.wait_for(self.stream.send([data]), 1.0)
        except (asyncio.TimeoutError, OSError, asyncio.CancelledError):
            return
        # the replies sent before this one must reach a pipelining client: no reset (wire.py);
        # a peer that never authenticated got no reply to protect and holds no slot longer
        if self.tenant is not None:
            await self.stream.drain_then_close(_DRAIN_S, _DRAIN_BYTES)

    def _close(self) -> None:
        if self._nixl_peer is not None and self.server.nixl is not None:
            self.server.agents.drop(self.server.nixl, self._nixl_peer)
            self._nixl_peer = None
        self.stream.close()
        self.server.forget(self)

    def _count_keys(self, op: str, statuses: list[p.Status]) -> None:
        counter = self.server.metrics.keys
        for status in set(statuses):
            counter.labels(op, status.name.lower()).inc(statuses.count(status))

    # ------------------------------------------------------------------ handlers
    async def _exists(self, header: p.Header, body: p.Exists) -> None:
        await self._reply(p.MsgType.EXISTS, header.request_id, p.ExistsReply(self.store.exists(body.keys)))

    def _charge(self) -> Charge:
        """A new request's charge against this connection's and its tenant's budgets (budgets.py)."""
        return self.store.budgets.charge(self.tenant.name if self.tenant is not None else "")

    async def _put(self, header: p.Header, body: p.Put) -> None:
        ticket = self.store.begin_put(body.keys, body.sizes, body.overwrite, self._charge())
        slab = self.store.slab
        ok = False
        try:
            run: list[memoryview] = []  # consecutive accepted values: one scattered receive
            for slot, size in zip(ticket.slots, ticket.sizes):
                if slot >= 0:
                    run.append(slab.value(slot, size))
                    continue
                if run:
                    await self.stream.read_into_many(run)
                    run = []
                await self.stream.skip(size)
            if run:
                await self.stream.read_into_many(run)
            ok = True
        finally:  # a disconnect (or a drain cancel) mid-put: the reserved slots go back
            self.store.end_put(ticket, ok)
        self._finish_put(ticket.status, sum(s for s, st in zip(ticket.sizes, ticket.status) if st is p.Status.OK), "tcp")
        await self._reply(p.MsgType.PUT, header.request_id, p.PutReply([int(s) for s in ticket.status]))

    async def _put_remote(self, header: p.Header, body: p.PutRemote) -> None:
        nixl, peer = self._nixl_path("PUT_REMOTE")
        status, nbytes = await nixl_requests.put_remote(self.store, nixl, peer, body, self._charge())
        self._finish_put(status, nbytes, "nixl")
        await self._reply(p.MsgType.PUT_REMOTE, header.request_id, p.PutReply([int(s) for s in status]))

    def _nixl_path(self, what: str) -> tuple[NixlEndpoint, str]:
        """The server's endpoint and this client's agent; refused if either is missing."""
        nixl, peer = self.server.nixl, self._nixl_peer
        if nixl is None or peer is None:
            raise p.UnknownMessageType(f"{what} needs the NIXL data path (none was set up)")
        return nixl, peer

    def _finish_put(self, statuses: list[p.Status], nbytes: int, path: str) -> None:
        self.stats.put_keys += len(statuses)
        self._count_keys("put", statuses)
        self.server.metrics.bytes.labels("in", path).inc(nbytes)

    async def _get(self, header: p.Header, body: p.Get) -> None:
        ticket = await self.store.begin_get(body.keys, body.capacities, self._charge())
        try:
            slab = self.store.slab
            payload = [slab.value(slot, size) for slot, size in zip(ticket.slots, ticket.sizes) if slot >= 0]
            reply = p.GetReply([int(s) for s in ticket.status], ticket.sizes)
            # counted as answered before the send: the client may act on the values (and read
            # these metrics) before this coroutine runs again after its last write
            self._finish_get(ticket.status, sum(ticket.sizes), "tcp")
            await self._reply(p.MsgType.GET, header.request_id, reply, payload)
        finally:
            self.store.end_get(ticket)

    async def _get_remote(self, header: p.Header, body: p.GetRemote) -> None:
        nixl, peer = self._nixl_path("GET_REMOTE")
        reply = await nixl_requests.get_remote(self.store, nixl, peer, body, self._charge())
        statuses = [p.Status(s) for s in reply.status]
        self._finish_get(statuses, sum(reply.sizes), "nixl")
        await self._reply(p.MsgType.GET_REMOTE, header.request_id, reply)

    def _finish_get(self, statuses: list[p.Status], nbytes: int, path: str) -> None:
        hits = statuses.count(p.Status.OK)
        self.stats.get_keys += len(statuses)
        self.stats.hits += hits
        self.stats.misses += len(statuses) - hits
        self._count_keys("get", statuses)
        self.server.metrics.bytes.labels("out", path).inc(nbytes)

    async def _delete(self, header: p.Header, body: p.Delete) -> None:
        await self._reply(p.MsgType.DELETE, header.request_id, p.DeleteReply(self.store.delete(body.keys)))

    async def _stats(self, header: p.Header, body: p.Stats) -> None:
        await self._reply(p.MsgType.STATS, header.request_id, self.server.stats_reply(self.tenant))

    async def _health(self, header: p.Header, body: p.Health) -> None:
        reply = p.HealthReply(
            status="draining" if self.server.draining else "ok",
            uptime_s=round(self.server.uptime_s, 3), connections=self.server.connection_count(self.tenant),
        )
        await self._reply(p.MsgType.HEALTH, header.request_id, reply)

    async def _agent_meta(self, header: p.Header, body: p.AgentMeta) -> None:
        if self.server.nixl is None or self._nixl_peer is None:
            raise p.UnknownMessageType("AGENT_META needs the NIXL data path (none was set up)")
        try:
            owner = self.tenant.name if self.tenant is not None else ""
            await self.server.agents.update(self.server.nixl, self._nixl_peer, owner, body.metadata)
        except AgentRefused as exc:
            raise p.Unauthorized(f"NIXL metadata refused: {exc}") from None
        except Exception as exc:
            raise p.MalformedBody(f"NIXL metadata refused: {exc}") from None
        await self._reply(p.MsgType.AGENT_META, header.request_id, p.Ack())
