"""The cache server's own configuration (``tiercache serve --config configs/server.yaml``).

Sources, highest precedence first: keyword overrides to :func:`load_server_config`,
``TIERCACHE_SERVER_*`` environment variables (nested with ``__``, e.g.
``TIERCACHE_SERVER_METRICS__PORT=9401``), the YAML file, the defaults below.
Every model forbids unknown keys; a bad value is a :class:`~tiercache.config.schema.ConfigError`
naming the key, raised before any memory is allocated or any socket is bound.

The tier chain reuses the engine's :class:`~tiercache.config.schema.TierConfig`: the
first tier is the server's host memory (``backend: cpu``), lower tiers (disk,
LMDB, plugins) receive what it stores (write_through) or evicts (write_back)
exactly as in an engine. Every chunk takes one host slot of
``max_value_bytes`` plus a small trailer (:mod:`tiercache.server.slab`), so
the host tier holds ``capacity // slot_bytes`` chunks of any size up to
``max_value_bytes``.

Authentication is on by default (``auth: token``): the tokens, tenants and
their rules are in :mod:`tiercache.server.config_auth`, the optional ``tls:``
section in :mod:`tiercache.server.tls`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from tiercache.config.schema import ByteSize, MetricsConfig, TierConfig, check_host_first
from tiercache.config.yaml_file import YamlBackedSettings, load_settings
from tiercache.server.config_auth import TenantConfig, check_auth, require_token, shorthand_tenants
from tiercache.server.slab import HEADER_ALLOWANCE
from tiercache.server.tls import ServerTlsConfig

DEFAULT_PORT = 7470
#: The one name of the server token on a node: engines (the server tier), the CLI and the server.
SHARED_TOKEN_ENV = "TIERCACHE_SERVER_TOKEN"


def _on_off(value: Any) -> Any:
    """YAML reads a bare ``on``/``off`` as a boolean: take it as the word."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


class ServerConfig(YamlBackedSettings):
    """Everything ``tiercache serve`` needs; frozen once built."""

    model_config = SettingsConfigDict(
        env_prefix="TIERCACHE_SERVER_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    name: str = Field(default="tiercache-server", max_length=128, description="Shown to clients.")
    host: str = Field(
        default="127.0.0.1",
        description="Bind address. Loopback by default; 0.0.0.0 serves other machines (only with "
        "auth: token).",
    )
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="TCP port; 0 = any free port.")
    port_file: Path | None = Field(
        default=None, description="Write the bound port here once listening (useful with port 0)."
    )
    auth: Literal["token", "none"] = Field(
        default="token",
        description="token: every HELLO must carry a configured token (auth_token or tenants); "
        "none: anyone who can connect is served (allowed on a loopback host only).",
    )
    auth_token: Annotated[SecretStr | None, AfterValidator(require_token)] = Field(
        default=None,
        description="Shorthand for one admin tenant named 'default' with this token (compared in "
        "constant time); empty is an error. Or list tenants.",
    )
    tenants: tuple[TenantConfig, ...] = Field(
        default=(),
        description="Tokens and the tenants they name: {name, token, space (default: name), admin}. "
        "A tenant reads, writes, deletes and sees only the chunks of its space.",
    )
    tls: ServerTlsConfig | None = Field(
        default=None,
        description="TLS on the control channel: {cert_file, key_file, client_ca_file (optional: "
        "require client certificates)}. Unset: plaintext TCP.",
    )
    max_value_bytes: ByteSize = Field(
        default=32 << 20,
        gt=0,
        description="Largest chunk accepted; every host slot holds one, so set it to the engines' "
        "chunk size (bytes per chunk per worker): smaller chunks still take a whole slot.",
    )
    max_message_bytes: ByteSize = Field(
        default=128 << 20, gt=0, description="Largest payload of one message (a batch of values)."
    )
    max_body_bytes: ByteSize = Field(
        default=1 << 20, ge=4096, le=16 << 20, description="Largest control body (keys, sizes)."
    )
    max_keys_per_message: int = Field(default=4096, ge=1, le=65536)
    max_key_bytes: int = Field(
        default=100, ge=8, le=1024,
        description="Longest key (the disk tier names files after keys: 100 at most there).",
    )
    # Resource bounds: tiercache/admission.py and tiercache/server/{deadlines,budgets}.py say how each is applied.
    max_connections: int = Field(
        default=256, ge=1, le=65536,
        description="Open connections; at the cap the oldest not yet authenticated is dropped for a "
        "new one, which is refused only when all have authenticated.",
    )
    max_connections_per_peer: int = Field(
        default=64, ge=1, le=65536, description="Open connections from one IP address (same rule)."
    )
    hello_timeout_s: float = Field(
        default=10.0, gt=0, description="A connection that has not said HELLO by then is closed."
    )
    idle_timeout_s: float | None = Field(
        default=300.0, gt=0, description="Close connections idle this long between requests (None: never)."
    )
    frame_timeout_s: float = Field(
        default=30.0, gt=0,
        description="A request must arrive, and its reply be read, within this plus its bytes at "
        "min_transfer_rate; else the connection closes and its slots are freed.",
    )
    min_transfer_rate: ByteSize = Field(
        default=1 << 20, gt=0, description="Bytes per second a payload (or NIXL transfer) is allowed."
    )
    nixl_timeout_s: float = Field(
        default=30.0, gt=0,
        description="A NIXL transfer not done within this plus its bytes at min_transfer_rate is "
        "cancelled and its keys FAILED.",
    )
    max_pinned_slots_per_connection: int | None = Field(
        default=None, ge=1,
        description="Host slots one request may reserve (PUT) or pin (GET) at once; past it keys get "
        "LIMIT. None: a quarter of the slots, at least one message of full-size values (and 16).",
    )
    max_pinned_slots_per_tenant: int | None = Field(
        default=None, ge=1,
        description="The same, summed over one tenant's connections. None: half of the slots, at least "
        "two connections' worth.",
    )
    max_inflight_bytes_per_tenant: ByteSize | None = Field(
        default=None, gt=0,
        description="Value bytes one tenant's requests may be moving at once (one request's: "
        "max_message_bytes). None: half the host capacity, at least two messages.",
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="SIGTERM: seconds to let in-flight requests and copies end."
    )
    when_full: Literal["evict", "refuse"] = Field(
        default="evict",
        description="evict: a put evicts the host tier's coldest chunks (the tiers' policies); "
        "refuse: a put that finds no free host slot fails (no eviction, like Redis noeviction).",
    )
    nixl: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = Field(
        default="auto",
        description="NIXL (UCX) data path: auto = offer it when nixl imports, on = required, off.",
    )
    tiers: tuple[TierConfig, ...] = Field(
        default=(TierConfig(name="cpu", backend="cpu", capacity=1 << 30),), min_length=1
    )
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="before")
    @classmethod
    def _token_from_the_shared_variable(cls, data: Any) -> Any:
        """``TIERCACHE_SERVER_TOKEN``, the engines' name for the token, also serves as ``auth_token``.

        Only where nothing else names the tokens (no ``auth_token``, no ``tenants``) and auth is
        ``token``: a node whose shell exports the variable for its engines can still run a server
        with tenants, or one with auth: none.
        """
        token = os.environ.get(SHARED_TOKEN_ENV)
        if (not isinstance(data, dict) or token is None or data.get("auth_token") is not None
                or data.get("tenants") or data.get("auth", "token") != "token"):
            return data
        return {**data, "auth_token": token}

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: duplicate tier names {sorted(names)}")
        check_host_first(self.tiers, "the server's host memory")
        if self.max_value_bytes + HEADER_ALLOWANCE > self.max_message_bytes:
            raise ValueError(
                f"max_value_bytes: {self.max_value_bytes} (+ {HEADER_ALLOWANCE} bytes of frame "
                f"header) is larger than max_message_bytes {self.max_message_bytes}: no message "
                "could carry such a value"
            )
        check_auth(self.auth, self.host, self.auth_token, self.tenants, self.max_key_bytes)
        return self

    def tenant_list(self) -> tuple[TenantConfig, ...]:
        """Every configured tenant (``auth_token`` as the one it stands for); empty with auth: none."""
        return self.tenants or shorthand_tenants(self.auth_token)


def load_server_config(config_file: str | Path | None = None, **overrides: Any) -> ServerConfig:
    """Build the server config; ConfigError naming every offending key.

    Unlike the engine's config errors, these do not echo the values given: a
    mistyped key could hold the ``auth_token``.
    """
    return load_settings(
        ServerConfig, config_file, overrides, title="invalid tiercache server config",
        show_input=False,
    )
