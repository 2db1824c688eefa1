"""The cache server: listen, accept, serve connections, drain on SIGTERM.

:class:`CacheServer` owns the listening socket, the
:class:`~tiercache.server.store.ChunkStore` (manager, host slab, lower tiers),
the optional NIXL endpoint, the Prometheus collectors and the set of open
:class:`~tiercache.server.connection.Connection` tasks. Everything runs on one
asyncio event loop thread (the manager is single-threaded by design); lower
tiers do their I/O on their own threads, and the metrics HTTP server reads
gauges from its own daemon thread.

Lifecycle (:meth:`CacheServer.run`): build the store (a persistent lower tier
is scanned and its chunks adopted: a warm restart), bind (127.0.0.1 unless
configured otherwise), write ``port_file`` if asked, serve. SIGTERM or SIGINT
starts a drain: the listener closes, idle connections are closed, requests in
flight finish and are answered (until ``drain_timeout_s``; then they are
cancelled, which frees whatever their puts had reserved), every queued
demotion is written to the lower tiers, the tiers are closed, and
:meth:`run` returns 0.

Security: the server's :class:`~tiercache.server.auth.TokenTable` names each
connection's tenant at HELLO (keys are scoped into its space by the
connection, :mod:`tiercache.server.tenants`); STATS and HEALTH show a
non-admin tenant only its own connections and counters
(:mod:`tiercache.server.tenant_stats`); NIXL agents are bound to the tenant
that loaded them (:mod:`tiercache.server.nixl_owners`); with ``tls:`` every
accepted socket is served through a TLS stream
(:mod:`tiercache.server.tls_stream`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
import time

from tiercache import __version__
from tiercache.admission import Admission
from tiercache.config.yaml_file import ConfigError
from tiercache.server import protocol as p
from tiercache.server import tenant_stats
from tiercache.server.auth import TokenTable
from tiercache.server.config import ServerConfig
from tiercache.server.connection import Connection
from tiercache.server.metrics import ServerMetrics
from tiercache.server.nixl_owners import AgentOwners
from tiercache.server.nixl_path import NixlEndpoint, nixl_available
from tiercache.server.store import ChunkStore
from tiercache.server.tenants import Tenant
from tiercache.server.tls import server_context

logger = logging.getLogger(__name__)

_STATS_REFRESH_S = 1.0


class CacheServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.limits = p.Limits(
            max_body_bytes=config.max_body_bytes,
            max_payload_bytes=config.max_message_bytes,
            max_keys=config.max_keys_per_message,
            max_key_bytes=config.max_key_bytes,
            max_value_bytes=config.max_value_bytes,
        )
        self.tokens = TokenTable.from_config(config)
        try:  # validated with the config already; a file changed since is still a config error
            self.tls: ssl.SSLContext | None = server_context(config.tls) if config.tls is not None else None
        except ValueError as exc:
            raise ConfigError(f"tls.{exc}") from None
        self.agents = AgentOwners()
        self.tenant_totals = tenant_stats.TenantTotals()
        self.store = ChunkStore(config)
        self.metrics = ServerMetrics()
        self.nixl: NixlEndpoint | None = None
        if config.nixl == "on" or (config.nixl == "auto" and nixl_available()):
            try:
                self.nixl = NixlEndpoint(config.name, self.store.slab.address, self.store.slab.nbytes,
                                         config.nixl_timeout_s, config.min_transfer_rate)
            except Exception as exc:
                if config.nixl == "on":
                    raise
                logger.warning("NIXL is installed but unusable (%s); TCP data path only", exc)
        self.connections: set[Connection] = set()
        self.admission: Admission[Connection] = Admission(
            config.max_connections, config.max_connections_per_peer, _before_hello)
        self.draining = False
        self.port: int | None = None
        self._started = time.monotonic()
        self._sessions = 0
        self._listener: socket.socket | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self._started

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Bind and start accepting; the port actually bound."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.config.host, self.config.port))
        listener.listen(512)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        if self.config.metrics.port is not None:
            self.metrics.serve(self.config.metrics.port, self.config.metrics.host)
        self._tasks = [
            loop.create_task(self._accept_loop(listener), name="tiercache-accept"),
            loop.create_task(self.store.pump.run(), name="tiercache-pump"),
            loop.create_task(self._refresh_gauges(), name="tiercache-gauges"),
        ]
        if self.config.port_file is not None:
            tmp = self.config.port_file.with_suffix(".tmp")
            tmp.write_text(f"{self.port}\n")
            tmp.replace(self.config.port_file)
        logger.info(
            "tiercache server %s listening on %s:%d (%d host slots of %d bytes, tiers %s, data paths %s, "
            "%s, auth %s)",
            self.config.name, self.config.host, self.port, self.store.slab.num_slots,
            self.store.slab.slot_bytes, [t.name for t in self.config.tiers],
            "tcp+nixl" if self.nixl else "tcp", "TLS" if self.tls else "plaintext",
            "none (loopback)" if self.tokens.open else f"{len(self.tokens.tenants)} token(s)",
        )
        return self.port

    async def run(self, install_signals: bool = True) -> int:
        """Serve until SIGTERM/SIGINT (or :meth:`request_stop`), then drain; 0 on a clean drain."""
        await self.start()
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        assert self._stop is not None
        await self._stop.wait()
        return await self.drain()

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def drain(self) -> int:
        """Stop accepting, finish requests in flight, copy queued chunks down, close."""
        self.draining = True
        timeout = self.config.drain_timeout_s
        deadline = time.monotonic() + timeout
        logger.info("draining: %d connections open", len(self.connections))
        if self._listener is not None:
            self._listener.close()
        for task in self._tasks[:1]:
            task.cancel()
        for conn in list(self.connections):
            if not conn.busy and conn.task is not None:
                conn.task.cancel()
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        leftover = [c.task for c in self.connections if c.task is not None]
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.gather(*leftover, return_exceptions=True)
        flushed = await self.store.pump.flush(max(0.0, deadline - time.monotonic()) + 1.0)
        self.store.pump.stop()
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.store.close()
        if self.nixl is not None:
            self.nixl.close()
        logger.info("drained (%s)", "all copies written" if flushed else "some copies were not written")
        return 0

    # ------------------------------------------------------------------ connections
    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as exc:
                if self.draining:
                    return
                logger.warning("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            host = str(addr[0]) if isinstance(addr, tuple) else peer
            victims = self.admission.make_room(host)  # the oldest unauthenticated make way (tiercache/admission.py)
            for victim in victims or ():
                self.forget(victim)
                self.metrics.refused.labels("evicted").inc()
                if victim.task is not None:  # (a task cancelled before it ran has not closed its socket)
                    victim.task.cancel()
                    victim.task.add_done_callback(lambda _, v=victim: v.stream.close())
            if victims is None:
                self.metrics.refused.labels("too_many_connections").inc()
                error = p.frame(p.MsgType.ERROR, 0, p.ErrorReply(
                    code="too_many_connections", message=f"limits are {self.config.max_connections} "
                    f"connections, {self.config.max_connections_per_peer} per address, all authenticated"
                ))
                try:
                    sock.setblocking(False)
                    sock.send(error)
                except OSError:
                    pass
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sessions += 1
            conn = Connection(self, sock, peer, self._sessions)
            self.connections.add(conn)
            self.admission.add(conn, host)
            self.metrics.connections.set(len(self.connections))
            conn.task = loop.create_task(conn.run(), name=f"tiercache-conn-{self._sessions}")
            await asyncio.sleep(0)  # its HELLO gets read before a flood's next connection can evict it

    def forget(self, conn: Connection) -> None:
        if conn in self.connections:
            self.tenant_totals.add_closed(conn.tenant, conn.stats)
        self.connections.discard(conn)
        self.admission.discard(conn)
        self.metrics.connections.set(len(self.connections))

    # ------------------------------------------------------------------ stats
    def connection_count(self, tenant: Tenant | None) -> int:
        return len(tenant_stats.visible(self.connections, tenant))

    def stats_reply(self, tenant: Tenant | None = None) -> p.StatsReply:
        """STATS: the whole server for an admin (or ``None``: the server itself), else ``tenant``'s view."""
        full = self._server_stats()
        if tenant is None or tenant.admin:
            return full
        mine = tenant_stats.visible(self.connections, tenant)
        clients = [c.stats.as_struct(c.stream.bytes_in, c.stream.bytes_out) for c in mine]
        counters = self.tenant_totals.of(tenant, (c.stats for c in mine))
        return tenant_stats.tenant_view(full, tenant, sorted(clients, key=lambda x: x.session), counters)

    def _server_stats(self) -> p.StatsReply:
        tiers = self.store.tier_stats()
        c = self.store.counters
        host = tiers[0]
        clients = [conn.stats.as_struct(conn.stream.bytes_in, conn.stream.bytes_out) for conn in self.connections]
        return p.StatsReply(
            server=self.config.name, version=__version__, uptime_s=round(self.uptime_s, 3),
            draining=self.draining, max_value_bytes=self.config.max_value_bytes,
            capacity_bytes=host.capacity_bytes, used_bytes=host.used_bytes,
            get_keys=c["get_keys"], hits=c["hits"], misses=c["misses"], put_keys=c["put_keys"],
            stored=c["stored"], refused_messages=int(sum(
                s.value for m in self.metrics.refused.collect() for s in m.samples if s.name.endswith("_total")
            )),
            tiers=tiers, clients=sorted(clients, key=lambda x: x.session),
        )

    async def _refresh_gauges(self) -> None:
        while True:
            for tier in self.store.tier_stats():
                self.metrics.used_bytes.labels(tier.name).set(tier.used_bytes)
                self.metrics.capacity_bytes.labels(tier.name).set(tier.capacity_bytes)
                self.metrics.chunks.labels(tier.name).set(tier.chunks)
            await asyncio.sleep(_STATS_REFRESH_S)


def serve(config: ServerConfig) -> int:
    """Run a server in this thread until SIGTERM/SIGINT; its exit status."""
    server = CacheServer(config)
    return asyncio.run(server.run())


def _before_hello(conn: Connection) -> int | None:
    """Admission's rank of a connection: 0 until HELLO named its tenant, then None (authenticated)."""
    return 0 if conn.tenant is None else None
