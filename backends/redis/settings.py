"""Options of a ``redis`` tier (``tiers[i].options`` in YAML), validated when the config loads.

:class:`RedisSettings` checks what can be checked without a server: the URL
scheme, cluster seed nodes, the cluster's limits, where credentials come from,
and that the connection pool fits the threads. :mod:`tiercache.backends.redis.backend`
(the tier itself) re-exports it.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from tiercache.backend import BackendSettings

#: URL schemes of a single server: TCP, TLS, unix socket.
SCHEMES = ("redis", "rediss", "unix")


def parse_host_port(node: str) -> tuple[str, int]:
    """``"10.0.0.5:7000"`` -> ``("10.0.0.5", 7000)``; ValueError if it is not host:port."""
    host, sep, port = node.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{node!r} is not host:port")
    return host.strip("[]"), int(port)


class RedisSettings(BackendSettings):
    """Options of a ``redis`` tier (``tiers[i].options`` in YAML)."""

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description=(
            "Server URL: redis://[user:password@]host:port/db, rediss:// (TLS) or "
            "unix:///path.sock?db=N. With cluster: true, a seed node unless `nodes` is given."
        ),
    )
    cluster: bool = Field(default=False, description="Talk to a Redis Cluster (RedisCluster).")
    nodes: tuple[str, ...] = Field(
        default=(), description="Cluster seed nodes as host:port (cluster: true only)."
    )
    ttl_seconds: int | None = Field(
        default=None, ge=1, description="Expire every chunk this long after it was written."
    )
    pipeline_batch: int = Field(
        default=16, ge=1, le=10_000, description="Chunks per pipelined round trip."
    )
    socket_timeout: float = Field(
        default=2.0, gt=0, description="Seconds one socket read or write may take."
    )
    connect_timeout: float = Field(default=1.0, gt=0, description="Seconds to connect.")
    max_connections: int = Field(
        default=16, ge=3,
        description="Connections per server (node); at least io_threads + 2.",
    )
    username: str | None = Field(default=None, description="ACL user, if the URL names none.")
    password: SecretStr | None = Field(
        default=None, description="Password, if the URL carries none (keeps it out of the URL)."
    )
    io_threads: int = Field(
        default=2, ge=1, le=64, description="Threads running put/get/delete jobs."
    )
    reconnect_initial_s: float = Field(
        default=0.1, gt=0, description="First wait before reconnecting after an outage."
    )
    reconnect_max_s: float = Field(
        default=10.0, gt=0, description="Longest wait between reconnect attempts."
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        scheme = urlsplit(url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
        return url

    @field_validator("nodes")
    @classmethod
    def _host_ports(cls, nodes: tuple[str, ...]) -> tuple[str, ...]:
        for node in nodes:
            parse_host_port(node)
        return nodes

    @model_validator(mode="after")
    def _consistent(self) -> RedisSettings:
        url = urlsplit(self.url)
        if self.nodes and not self.cluster:
            raise ValueError("nodes is for cluster: true; a single server is named by url")
        if self.cluster and url.scheme != "redis":
            raise ValueError("cluster: true supports redis:// seed nodes only (no TLS, no unix)")
        if self.cluster and url.path not in ("", "/", "/0"):
            raise ValueError("a Redis Cluster has database 0 only")
        if (self.username and url.username) or (self.password and url.password):
            raise ValueError("name the username and password either in the url or as options")
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError("reconnect_max_s must be >= reconnect_initial_s")
        if self.max_connections < self.io_threads + 2:
            raise ValueError(
                f"max_connections {self.max_connections} < io_threads + 2 "
                f"({self.io_threads + 2}: the I/O threads, the lookup thread, the owner)"
            )
        return self
