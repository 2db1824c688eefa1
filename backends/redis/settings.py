"""Options of a ``redis`` tier (``tiers[i].options`` in YAML), validated when the config loads.

:class:`RedisSettings` checks what can be checked without a server: the URL
scheme, cluster seed nodes, the cluster's limits, where credentials come from,
the TLS files, and that the connection pool fits the threads.
:mod:`tiercache.backends.redis.backend` (the tier itself) re-exports it.

Secrets. A password is a SecretStr (shown as ``**********``); one written in
the url is moved out of it into ``password`` when the settings load, so the
url kept, shown and logged holds none. ``password_env`` names an environment
variable and ``password_file`` a file instead (read by
:mod:`tiercache.backends.redis.auth` at every connection). No error message
of this module quotes the url or a secret.
"""

from __future__ import annotations

import os
from typing import Annotated, Any
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from tiercache.backend import BackendSettings
from tiercache.mac import check_mac_secret, mac_key_default

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

    # An error must not echo the options it was given: they may hold a password.
    model_config = ConfigDict(hide_input_in_errors=True)

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description=(
            "Server URL: redis://[user[:password]@]host:port/db, rediss:// (TLS) or "
            "unix:///path.sock?db=N (no other query options). With cluster: true, a seed node "
            "unless `nodes` is given. A password in it is moved into `password` at load."
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
    username: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="ACL user (AUTH username password); unset: the default user.",
    )
    password: SecretStr | None = Field(
        default=None, description="Password of the user (requirepass for the default user). "
        "Never shown or logged. Prefer password_env or password_file to writing it in YAML.",
    )
    password_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of an environment variable holding the password, e.g. "
        "REDIS_PASSWORD; it must be set and non-empty when the config loads.",
    )
    password_file: str | None = Field(
        default=None, min_length=1,
        description="File holding the password (one trailing newline ignored), read again at "
        "every (re)connection: rotate the password by rewriting the file.",
    )
    tls: bool = Field(
        default=False, description="Speak TLS, as a rediss:// url does (certificate verified)."
    )
    ca_file: str | None = Field(
        default=None, min_length=1,
        description="TLS: CA certificates (PEM) to verify the server with; unset: the system's.",
    )
    cert_file: str | None = Field(
        default=None, min_length=1,
        description="TLS: client certificate (PEM), for a server with tls-auth-clients; "
        "needs key_file.",
    )
    key_file: str | None = Field(
        default=None, min_length=1, description="TLS: the client certificate's private key (PEM).",
    )
    server_name: str | None = Field(
        default=None, min_length=1,
        description="TLS: the name the server's certificate must carry (and SNI); unset: the "
        "host in url or nodes.",
    )
    check_hostname: bool = Field(
        default=True, description="TLS: require the certificate to name the server. Off: any "
        "certificate signed by the CA is accepted (the CA is still checked).",
    )
    mac_key: Annotated[SecretStr | None, AfterValidator(check_mac_secret)] = Field(
        default_factory=mac_key_default, validate_default=True,
        description="Secret (16+ random characters) that authenticates every chunk with a keyed MAC: "
        "only chunks written with the same key load. Default: $TIERCACHE_MAC_KEY; unset: xxh3 "
        "checksums only. Empty is an error.",
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
        if self.cluster and url.scheme == "unix":
            raise ValueError("cluster: true needs redis:// or rediss:// seed nodes (no unix)")
        if self.cluster and url.path not in ("", "/", "/0"):
            raise ValueError("a Redis Cluster has database 0 only")
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError("reconnect_max_s must be >= reconnect_initial_s")
        if self.max_connections < self.io_threads + 2:
            raise ValueError(
                f"max_connections {self.max_connections} < io_threads + 2 "
                f"({self.io_threads + 2}: the I/O threads, the lookup thread, the owner)"
            )
        return self

    # ------------------------------------------------------------ access (credentials, TLS)
    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_url(cls, data: Any) -> Any:
        """Move a username and password written in the url into the options (url left clean)."""
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        url = urlsplit(data["url"])
        if url.username is None and url.password is None:
            return data
        if (url.username and data.get("username") is not None) or (
            url.password and any(data.get(k) is not None for k in PASSWORD_OPTIONS)
        ):
            raise ValueError("name the username and password either in the url or as options")
        moved = dict(data, url=url._replace(netloc=url.netloc.rpartition("@")[2]).geturl())
        if url.username:
            moved["username"] = unquote(url.username)
        if url.password:
            moved["password"] = SecretStr(unquote(url.password))
        return moved

    @model_validator(mode="after")
    def _access(self) -> RedisSettings:
        url = urlsplit(self.url)
        sources = [k for k in PASSWORD_OPTIONS if getattr(self, k) is not None]
        if len(sources) > 1:
            raise ValueError(f"name one password source, not {' and '.join(sources)}")
        if self.password is not None and not self.password.get_secret_value():
            raise ValueError("password: empty (leave it out for a server without one)")
        if self.password_env is not None and not os.environ.get(self.password_env):
            raise ValueError(f"password_env: environment variable {self.password_env} is not set "
                             "or empty")
        unknown = sorted(set(parse_qs(url.query, keep_blank_values=True)) - {"db"})
        if unknown:
            raise ValueError(f"url: query options {unknown} are not supported; use the tier's "
                             "options")
        if self.database() != 0 and self.cluster:  # database(): ValueError if not a number
            raise ValueError("a Redis Cluster has database 0 only")
        try:
            url.port
        except ValueError:
            raise ValueError("url: the port is not a number") from None
        if self.tls and url.scheme == "unix":
            raise ValueError("tls: true needs a redis:// or rediss:// url, not unix://")
        tls_only = [k for k in TLS_OPTIONS if getattr(self, k) is not None]
        if tls_only and not self.uses_tls:
            raise ValueError(f"{', '.join(tls_only)}: TLS options, but there is neither "
                             "tls: true nor a rediss:// url")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        for key in ("password_file", *TLS_FILES):
            path = getattr(self, key)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{key}: {path} is not a file")
        return self

    @property
    def uses_tls(self) -> bool:
        """Whether connections speak TLS (``tls: true`` or a rediss:// url)."""
        return self.tls or urlsplit(self.url).scheme == "rediss"

    def database(self) -> int:
        """The database number the url names (``/N`` or ``?db=N``; 0 if none)."""
        url = urlsplit(self.url)
        named = parse_qs(url.query).get("db", [])
        text = named[-1] if named else ("" if url.scheme == "unix" else url.path.strip("/"))
        if text and not text.isdigit():
            raise ValueError("url: the database is a number, as in redis://host:port/0")
        return int(text or 0)

    def address(self) -> str:
        """Where the tier connects, for messages: host:port, the socket path, or the seeds."""
        url = urlsplit(self.url)
        if url.scheme == "unix":
            return unquote(url.path)
        seeds = self.nodes if self.cluster and self.nodes else ()
        first = f"{url.hostname or '127.0.0.1'}:{url.port or 6379}"
        return ", ".join(seeds) if seeds else first


#: Options that each give the password (at most one may be set).
PASSWORD_OPTIONS = ("password", "password_env", "password_file")
#: Options that only mean something over TLS; files among them must exist when the config loads.
TLS_FILES = ("ca_file", "cert_file", "key_file")
TLS_OPTIONS = (*TLS_FILES, "server_name")
