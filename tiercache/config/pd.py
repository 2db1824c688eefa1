"""The P/D section of the engine config (``pd:``): hand-off mode, side channel, its security, the consumer's trust.

:class:`PDConfig` is one part of :class:`tiercache.config.schema.TierCacheConfig`
(re-exported there). Security settings (docs/pd.md, "Security"): ``secret`` /
``secret_file`` (the side channel's shared secret, required when the producer
binds anything but loopback), ``trusted_producers`` (whom a consumer reads
from), ``store_unverified``, and the side channel's bounds
(``max_connections``, ``max_connections_per_peer``, ``handshake_timeout_s``,
``idle_timeout_s``).

The secret is a pydantic ``SecretStr`` from the first moment (a string given
in YAML, inline or as ``TIERCACHE_PD__SECRET`` is wrapped before any check),
so a validation error never prints it; :meth:`PDConfig.secret_key` is the only
way to its bytes. :func:`is_loopback` and :func:`parse_producer` are the
address rules every P/D room uses (tiercache.pd imports them from here).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tiercache.config.hosts import (
    is_loopback as is_loopback,  # the P/D rooms take address rules from here
)

MIN_SECRET_CHARS = 16


def normal_host(host: str) -> str:
    """A host as the trust rules compare it: an IP in its canonical form, a name in lower case."""
    host = host.strip().strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()


def parse_producer(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port`` or ``[v6]:port`` as (normal host, port or None); ValueError if malformed."""
    text = entry.strip()
    port: int | None = None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{entry!r}: expected [address]:port")
        rest = rest[1:]
    elif text.count(":") == 1:
        host, _, rest = text.partition(":")
    else:
        host, rest = text, ""  # a name, an IPv4 address or a bare IPv6 address
    if rest:
        if not rest.isdigit() or not 0 < int(rest) < 65536:
            raise ValueError(f"{entry!r}: port {rest!r} is not 1..65535")
        port = int(rest)
    if not host or any(c.isspace() or c in "/@" for c in host):
        raise ValueError(f"{entry!r}: expected host or host:port")
    return normal_host(host), port


class PDConfig(BaseModel):
    """Prefill/decode hand-off (kv_role kv_producer / kv_consumer; see docs/pd.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


    mode: Literal["via_host", "direct"] = Field(
        default="via_host",
        description="Producer: via_host (default): the prompt's chunks are copied into the host tier, "
        "registered with NIXL, and the device blocks are freed at once. direct: the device blocks "
        "stay allocated (pinned by tiercache in vLLM's block pool) until the consumer has read them "
        "straight from the engine's KV tensors (no host copy on either side), or until "
        "handoff_timeout_s.",
    )
    nixl_error_handling: Literal["none", "peer"] = Field(
        default="none",
        description="UCX error-handling mode of tiercache's NIXL agents. none (default): one-sided "
        "transports (shared memory / CMA on one host, RDMA) are allowed, so a read needs no help "
        "from the producer's CPU; a dead producer still fails the read (or read_timeout_s does). "
        "peer: UCX's peer-failure handling, which on one host rules out those transports (UCX "
        "falls back to tcp, and the producer must progress UCX for every read).",
    )
    busy_progress: bool | None = Field(
        default=None,
        description="Producer: while hand-offs are held, run a thread that progresses UCX every "
        "0.2 ms (needed when reads go over tcp; with one-sided transports nothing needs it). "
        "Default: on with nixl_error_handling peer, off with none.",
    )
    host: str = Field(
        default="127.0.0.1",
        description="Producer: address its side channel binds and advertises to consumers.",
    )
    port: int = Field(
        default=5700, ge=1, le=65535 - 64,
        description="Producer: side-channel TCP port of TP rank 0 (rank r listens on port + r).",
    )
    handoff_timeout_s: float = Field(
        default=120.0, gt=0,
        description="Producer: a hand-off nobody read after this long is released (its memory returns).",
    )
    read_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Consumer: longest wait for a producer (handshake, readiness, the NIXL read); "
        "past it the load fails and the engine recomputes.",
    )
    keep_received: bool = Field(
        default=True,
        description="Consumer: offer what a hand-off delivered to its own host tier (the normal store "
        "path: a copy out of the blocks per hand-off; both modes READ straight into the blocks). "
        "false: a pure decode engine.",
    )
    huge_pages: bool = Field(
        default=True,
        description="Back the host memory a peer's NIXL READ copies from or into with 2 MiB "
        "transparent huge pages: the host slab (a prefaulted slab only) and, where vLLM keeps the KV "
        "cache in host memory (its CPU platform), the engine's KV tensors, moved in place at "
        "start-up (MADV_COLLAPSE, contents kept). On one host a READ pins its source one 4 KiB "
        "page at a time: 31.5 MiB took 3.3 ms from small pages and 1.8 ms from huge ones "
        "(docs/PERFORMANCE.md). Best effort: a kernel without THP (or set to never) keeps small "
        "pages, and the worker's log says how much became huge.",
    )
    max_peer_chunks: int = Field(
        default=65536, ge=1,
        description="Consumer: how many announced producer chunks it remembers at once.",
    )
    secret_file: Path | None = Field(
        default=None,
        description="A file whose first line is the side channel's secret (instead of secret; read at "
        "start-up). Keep it readable by the engine's user only.",
    )
    trusted_producers: tuple[str, ...] = Field(
        default=(),
        description="Consumer: the producers it reads from, each host or host:port (the producer's pd.port, "
        "its TP rank 0; its other ranks' ports follow). A hand-off naming any other producer is refused "
        "before anything connects to it, and its prompt is computed here. Empty: with a secret, any "
        "producer that proves it holds the secret; without one, loopback addresses only. Engine ids are "
        "not accepted: the hand-off's engine id is the client's claim, like its address.",
    )
    warm_up_s: float = Field(
        default=60.0, ge=0, le=3600,
        description="Consumer: for this long after start-up, shake hands with every trusted_producers entry "
        "that names a port (this rank's producer rank: port + rank) and READ a little of its memory, every "
        "second until it answers, so the first hand-off from it pays neither the handshake nor a cold READ; "
        "a refusal or a wrong secret is logged then. 0: the first hand-off shakes hands.",
    )
    store_unverified: bool = Field(
        default=False,
        description="Consumer with keep_received: also store hand-off chunks no hash could verify (mode "
        "direct, another TP size, KV in GPU memory; see docs/pd.md, Security). false: they are used for "
        "their request only.",
    )
    max_connections: int = Field(
        default=256, ge=2, le=65536,
        description="Producer: side-channel connections at once (each rank); when full, the oldest not yet "
        "authenticated is dropped for a newcomer.",
    )
    max_connections_per_peer: int = Field(
        default=64, ge=1, le=65536,
        description="Producer: side-channel connections from one peer address at once; when full, that "
        "address's oldest unauthenticated connection is dropped for a newcomer.",
    )
    handshake_timeout_s: float = Field(
        default=5.0, gt=0, le=600,
        description="Producer: a connection that has not authenticated within this long is closed.",
    )
    idle_timeout_s: float = Field(
        default=900.0, gt=0,
        description="Producer: an authenticated connection silent this long is closed (the consumer shakes "
        "hands again at its next read).",
    )
    secret: SecretStr | None = Field(
        default=None, validate_default=True,
        description="Shared secret of the P/D side channel: producer and consumer each prove they hold it "
        "(HMAC-SHA256 challenge-response over both sides' nonces) before the producer reveals anything. "
        f"Required when host is not a loopback address; at least {MIN_SECRET_CHARS} characters (e.g. "
        "`openssl rand -hex 32`). Env: TIERCACHE_PD__SECRET. Never logged.",
    )

    @model_validator(mode="before")
    @classmethod
    def _hide_secret(cls, data: Any) -> Any:
        """A secret given as a string is a SecretStr before anything can put it in an error message."""
        if isinstance(data, dict) and isinstance(data.get("secret"), str):
            data = {**data, "secret": SecretStr(data["secret"])}
        return data

    @field_validator("trusted_producers")
    @classmethod
    def _check_producers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            parse_producer(entry)
        return value

    @field_validator("secret")
    @classmethod
    def _check_secret(cls, secret: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        """After every other field (declared last): length, secret vs secret_file, loopback-only without one."""
        path = info.data.get("secret_file")
        if secret is not None and path is not None:
            raise ValueError("pd.secret and pd.secret_file: give one of them, not both")
        if secret is not None and len(secret.get_secret_value()) < MIN_SECRET_CHARS:
            raise ValueError(f"pd.secret: at least {MIN_SECRET_CHARS} characters")
        if path is not None:
            _read_secret_file(path)
        host = info.data.get("host", "127.0.0.1")
        if secret is None and path is None and not is_loopback(host):
            raise ValueError(f"pd.secret: required when pd.host ({host}) is not a loopback address: anyone "
                             "who reaches the side channel could otherwise read and write the producer's memory "
                             "(set pd.secret, pd.secret_file or TIERCACHE_PD__SECRET)")
        return secret

    def secret_key(self) -> bytes:
        """The shared secret's bytes (empty: none configured, loopback only)."""
        if self.secret is not None:
            return self.secret.get_secret_value().encode()
        if self.secret_file is not None:
            return _read_secret_file(self.secret_file)
        return b""


def _read_secret_file(path: Path) -> bytes:
    """The first line of ``path`` (ValueError naming pd.secret_file, never the content)."""
    try:
        lines = path.expanduser().read_bytes().splitlines()
    except OSError as exc:
        raise ValueError(f"pd.secret_file: cannot read {path}: {exc.strerror or exc}") from None
    secret = lines[0].strip() if lines else b""
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"pd.secret_file: {path}: the secret (its first line) has fewer than "
                         f"{MIN_SECRET_CHARS} characters")
    return secret
