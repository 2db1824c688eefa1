"""The client layer of the Redis tier: connections that send frames unjoined, and clients.

:func:`connect` makes a redis-py client (one server or a cluster) whose
connections serialize a :class:`Framed` argument as RESP pieces, so a
chunk's payload view goes from the caller's buffer to the socket without a
copy (and is never kept past the send); :func:`close_client` closes one;
``TROUBLE`` tells a lost server from one failed command. How the tier uses
them (I/O, buffers, failures) is told in :mod:`tiercache.backends.redis.backend`.

Access: every connection authenticates through the tier's
:class:`~tiercache.backends.redis.auth.Credentials` (when a user or password
is configured) and, with TLS, wraps its socket in the client's one
``SSLContext``, checking the certificate against ``server_name`` or the host
it dials (the same for every node of a cluster). A connect that fails for
credentials or TLS raises the words of :func:`~tiercache.backends.redis.auth.explain`.
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterError, RedisClusterException, RedisError
from redis.retry import Retry
from tiercache.backends.redis.auth import Credentials, explain, has_credentials, tls_context
from tiercache.backends.redis.settings import RedisSettings, parse_host_port

# The tier's one logger: its backend module's name, the name log configurations filter on.
logger = logging.getLogger(f"{__package__}.backend")

Client = redis.Redis | RedisCluster
#: Errors that say the server (or the path to it) is gone, not that one command failed.
TROUBLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterError,  # ClusterDownError, MasterDownError: no usable master for a slot
    RedisClusterException,  # no reachable startup node, slot not covered
    OSError,
)


# ------------------------------------------------------------------- serializing frames
class Framed:
    """A frame as one command argument: our header, then the caller's payload (not joined)."""

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes | bytearray, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    def __len__(self) -> int:
        return len(self.header) + self.payload.nbytes

    def __repr__(self) -> str:
        return f"<frame of {len(self)} bytes>"


class _FramePacker:
    """redis-py's command serializer, taught one more argument type: :class:`Framed`.

    A command without a frame goes to redis-py's own serializer. One with a
    frame becomes RESP pieces: the bytes up to the frame's payload (the frame
    header included) joined, then the payload view itself, which the
    connection passes straight to ``socket.sendall``.
    """

    def __init__(self, fallback: Any) -> None:
        self._fallback = fallback

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if not any(type(arg) is Framed for arg in args):
            return self._fallback.pack(*args)
        pieces: list[bytes | memoryview] = []
        head = [b"*%d\r\n" % len(args)]
        for arg in args:
            if type(arg) is Framed:
                head += (b"$%d\r\n" % len(arg), bytes(arg.header))
                pieces += (b"".join(head), arg.payload)
                head = [b"\r\n"]
            else:
                value = _encode_arg(arg)
                head += (b"$%d\r\n" % len(value), value, b"\r\n")
        pieces.append(b"".join(head))
        return pieces


def _encode_arg(arg: Any) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int) and not isinstance(arg, bool):
        return b"%d" % arg
    if isinstance(arg, (bytearray, memoryview)):
        return bytes(arg)
    raise redis.DataError(f"cannot send an argument of type {type(arg).__name__}")


class _FramingMixin:
    """Connections whose serializer sends frames without joining them (see _FramePacker)."""

    def _construct_command_packer(self, packer: Any) -> _FramePacker:
        return _FramePacker(super()._construct_command_packer(packer))  # type: ignore[misc]


class _FramingConnection(_FramingMixin, redis.Connection):
    pass


class _FramingUnixConnection(_FramingMixin, redis.UnixDomainSocketConnection):
    pass


class _FramingTLSConnection(_FramingConnection):
    """A framing connection over TLS: the TCP socket wrapped in the client's one context.

    The context and the name to verify are class attributes of a subclass made
    per client (:func:`_tls_connection_class`): redis-py's cluster hands its
    nodes' pools only the keyword arguments it knows, but it does hand them
    the connection class.
    """

    tls: ClassVar[ssl.SSLContext]
    server_name: ClassVar[str | None] = None

    def _connect(self) -> socket.socket:
        sock = super()._connect()
        try:  # the handshake runs under the socket timeout set by super()._connect()
            return self.tls.wrap_socket(sock, server_hostname=self.server_name or self.host)
        except BaseException:
            sock.close()
            raise


def _tls_connection_class(context: ssl.SSLContext, server_name: str | None) -> type[Any]:
    return type("_ClientTLSConnection", (_FramingTLSConnection,),
                {"tls": context, "server_name": server_name})


def _connection_class(settings: RedisSettings) -> type[Any]:
    context = tls_context(settings)
    if context is not None:
        return _tls_connection_class(context, settings.server_name)
    if urlsplit(settings.url).scheme == "unix":
        return _FramingUnixConnection
    return _FramingConnection


def connect(settings: RedisSettings, client_name: str) -> Client:
    """A new client for ``settings`` that has answered a PING (every master, for a cluster).

    redis-py's own retries are off (one attempt, no sleep): this tier decides
    when to try again. Raises a RedisError, RedisClusterException or OSError
    when the server is not there; credentials refused or TLS trouble raise
    :class:`~tiercache.backends.redis.auth.RedisAuthError` or
    :class:`~tiercache.backends.redis.auth.RedisTLSError`, whose words name the
    user and the server, never the password.
    """
    common: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
        "socket_keepalive": True,
        "max_connections": settings.max_connections,
        "retry": Retry(NoBackoff(), 0),
        "client_name": client_name,
    }
    if has_credentials(settings):
        common["credential_provider"] = Credentials(settings)
    client: Client | None = None
    try:
        connection_class = _connection_class(settings)
        client = (_cluster_client(settings, common, connection_class) if settings.cluster
                  else _client(settings, common, connection_class))
        if isinstance(client, RedisCluster):
            client.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            client.ping()
    except Exception as exc:
        if client is not None:
            close_client(client)
        explained = explain(exc, settings)
        if explained is exc:
            raise
        raise explained from None
    except BaseException:
        if client is not None:
            close_client(client)
        raise
    return client


def _client(settings: RedisSettings, common: dict[str, Any],
            connection_class: type[Any]) -> redis.Redis:
    url = urlsplit(settings.url)
    where: dict[str, Any] = (
        {"path": unquote(url.path)} if url.scheme == "unix"
        else {"host": url.hostname or "127.0.0.1", "port": url.port or 6379}
    )
    pool = redis.BlockingConnectionPool(
        connection_class=connection_class,
        timeout=settings.connect_timeout,  # waiting for a free connection
        db=settings.database(),
        **where,
        **common,
    )
    return redis.Redis(connection_pool=pool)


def _cluster_client(settings: RedisSettings, common: dict[str, Any],
                    connection_class: type[Any]) -> RedisCluster:
    """A RedisCluster whose node connections are framing ones (over TLS if configured).

    redis-py hands ``connection_class`` to the nodes' connection pools only
    when the cluster is opened from a URL, so the first seed is given as one
    (its port and host only: credentials travel in ``common``, TLS in the class).
    """
    url = urlsplit(settings.url)
    seeds = [parse_host_port(node) for node in settings.nodes] or [
        (url.hostname or "127.0.0.1", url.port or 6379)
    ]
    host, port = seeds[0]
    return RedisCluster(
        url=f"redis://{f'[{host}]' if ':' in host else host}:{port}/0",
        startup_nodes=[ClusterNode(h, p) for h, p in seeds[1:]],
        connection_class=connection_class,
        require_full_coverage=True,
        **common,
    )


def close_client(client: Client) -> None:
    """Close ``client`` and every connection of its pools; errors are logged, not raised."""
    try:
        client.close()
        if isinstance(client, redis.Redis):  # a pool passed in is not closed by close()
            client.connection_pool.disconnect()
    except (RedisError, RedisClusterException, OSError) as exc:
        logger.debug("redis tier: closing a client: %s", exc)
