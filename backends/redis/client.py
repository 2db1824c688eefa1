"""The client layer of the Redis tier: connections that send frames unjoined, and clients.

:func:`connect` makes a redis-py client (one server or a cluster) whose
connections serialize a :class:`Framed` argument as RESP pieces, so a
chunk's payload view goes from the caller's buffer to the socket without a
copy (and is never kept past the send); :func:`close_client` closes one;
``TROUBLE`` tells a lost server from one failed command. How the tier uses
them (I/O, buffers, failures) is told in :mod:`tiercache.backends.redis.backend`.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterError, RedisClusterException, RedisError
from redis.retry import Retry

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


class _FramingSSLConnection(_FramingMixin, redis.SSLConnection):
    pass


class _FramingUnixConnection(_FramingMixin, redis.UnixDomainSocketConnection):
    pass


_CONNECTIONS: dict[str, type[Any]] = {
    "redis": _FramingConnection,
    "rediss": _FramingSSLConnection,
    "unix": _FramingUnixConnection,
}


def connect(settings: RedisSettings, client_name: str) -> Client:
    """A new client for ``settings`` that has answered a PING (every master, for a cluster).

    redis-py's own retries are off (one attempt, no sleep): this tier decides
    when to try again. Raises a RedisError, RedisClusterException or OSError
    when the server is not there.
    """
    common: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
        "socket_keepalive": True,
        "max_connections": settings.max_connections,
        "retry": Retry(NoBackoff(), 0),
        "client_name": client_name,
    }
    url = urlsplit(settings.url)
    username = settings.username or url.username
    password = settings.password.get_secret_value() if settings.password else url.password
    if username:
        common["username"] = username
    if password:
        common["password"] = password
    client = _cluster_client(settings, common) if settings.cluster else _client(settings, common)
    try:
        if isinstance(client, RedisCluster):
            client.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            client.ping()
    except BaseException:
        close_client(client)
        raise
    return client


def _client(settings: RedisSettings, common: dict[str, Any]) -> redis.Redis:
    pool = redis.BlockingConnectionPool.from_url(
        settings.url,
        connection_class=_CONNECTIONS[urlsplit(settings.url).scheme],
        timeout=settings.connect_timeout,  # waiting for a free connection
        **common,
    )
    return redis.Redis(connection_pool=pool)


def _cluster_client(settings: RedisSettings, common: dict[str, Any]) -> RedisCluster:
    """A RedisCluster whose node connections are framing ones.

    redis-py hands ``connection_class`` to the nodes' connection pools only
    when the cluster is opened from a URL, so the first seed is given as one
    (its port and host only: credentials travel in ``common``).
    """
    url = urlsplit(settings.url)
    seeds = [parse_host_port(node) for node in settings.nodes] or [
        (url.hostname or "127.0.0.1", url.port or 6379)
    ]
    host, port = seeds[0]
    return RedisCluster(
        url=f"redis://{f'[{host}]' if ':' in host else host}:{port}/0",
        startup_nodes=[ClusterNode(h, p) for h, p in seeds[1:]],
        connection_class=_FramingConnection,
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
