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
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from tiercache.config.schema import ByteSize, MetricsConfig, TierConfig, check_host_first
from tiercache.config.yaml_file import YamlBackedSettings, load_settings

DEFAULT_PORT = 7470


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
        description="Bind address. Loopback by default; set 0.0.0.0 (and an auth_token) to serve "
        "other machines.",
    )
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="TCP port; 0 = any free port.")
    port_file: Path | None = Field(
        default=None, description="Write the bound port here once listening (useful with port 0)."
    )
    auth_token: SecretStr | None = Field(
        default=None,
        description="Shared secret every client must present in its HELLO (compared in constant "
        "time). Unset: no authentication (loopback use only).",
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
    max_connections: int = Field(default=256, ge=1, le=65536)
    hello_timeout_s: float = Field(
        default=10.0, gt=0, description="A connection that has not said HELLO by then is closed."
    )
    idle_timeout_s: float | None = Field(
        default=None, gt=0, description="Close connections idle this long (None: never)."
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

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: duplicate tier names {sorted(names)}")
        check_host_first(self.tiers, "the server's host memory")
        if self.max_value_bytes > self.max_message_bytes:
            raise ValueError(
                f"max_value_bytes: {self.max_value_bytes} is larger than max_message_bytes "
                f"{self.max_message_bytes}: no message could carry such a value"
            )
        return self


    @property
    def token(self) -> str | None:
        return self.auth_token.get_secret_value() if self.auth_token is not None else None


def load_server_config(config_file: str | Path | None = None, **overrides: Any) -> ServerConfig:
    """Build the server config; ConfigError naming every offending key.

    Unlike the engine's config errors, these do not echo the values given: a
    mistyped key could hold the ``auth_token``.
    """
    return load_settings(
        ServerConfig, config_file, overrides, title="invalid tiercache server config",
        show_input=False,
    )
