"""The cache-server tier's options (``options:`` of a ``backend: server`` tier in YAML).

Plain validated data, read by :class:`~tiercache.backends.server.backend.ServerBackend`
and its I/O threads (:mod:`tiercache.backends.server.worker`); the address is
checked here, when the configuration is read, and so are the TLS files
(:class:`~tiercache.server.tls.ClientTlsConfig`: they must load). The token
is the server tenant's (``token``, else the ``TIERCACHE_SERVER_TOKEN``
environment variable, the one ``tiercache inspect`` reads too); it is a
:class:`~pydantic.SecretStr`, never shown.
"""

from __future__ import annotations

import os
import ssl
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, SecretStr, field_validator

from tiercache.backend import BackendSettings
from tiercache.config.schema import ByteSize
from tiercache.mac import check_mac_secret, mac_key_default
from tiercache.server.client import parse_address
from tiercache.server.config_auth import require_token
from tiercache.server.tls import ClientTlsConfig, client_context

TOKEN_ENV = "TIERCACHE_SERVER_TOKEN"


def _token_from_env() -> SecretStr | None:
    value = os.environ.get(TOKEN_ENV)
    return SecretStr(value) if value is not None else None


class ServerSettings(BackendSettings):
    """Options of a ``backend: server`` tier."""

    address: str = Field(description="HOST:PORT of the cache server (tiercache serve).")
    token: Annotated[SecretStr | None, AfterValidator(require_token)] = Field(
        default_factory=_token_from_env, validate_default=True,
        description="This engine's tenant token on the server (its auth_token or a tenants entry); "
        "default: $TIERCACHE_SERVER_TOKEN; unset for a server with auth: none. Empty is an error.",
    )
    mac_key: Annotated[SecretStr | None, AfterValidator(check_mac_secret)] = Field(
        default_factory=mac_key_default, validate_default=True,
        description="Secret (16+ random characters) that authenticates every chunk with a keyed MAC: "
        "only chunks written with the same key load, so a client without it cannot poison them. "
        "Default: $TIERCACHE_MAC_KEY; unset: xxh3 checksums only. Empty is an error.",
    )
    tls: ClientTlsConfig | None = Field(
        default=None,
        description="TLS to the server: {ca_file (default: system CAs), cert_file + key_file (mutual "
        "TLS), server_name (default: the address's host)}. Unset: plaintext TCP. With NIXL only the "
        "control channel is TLS; values move over NIXL/UCX unencrypted.",
    )
    connections: int = Field(default=2, ge=1, le=32, description="TCP connections for jobs (one I/O thread each); lookups and deletes use one more.")
    timeout_s: float = Field(default=10.0, gt=0, description="Seconds one request may take.")
    connect_timeout_s: float = Field(default=2.0, gt=0)
    backoff_min_s: float = Field(default=0.05, gt=0, description="First wait before reconnecting.")
    backoff_max_s: float = Field(default=5.0, gt=0, description="Longest wait between reconnects.")
    data_path: Literal["auto", "tcp", "nixl"] = Field(
        default="auto",
        description="auto: NIXL when both sides have it, else TCP; tcp: never NIXL; "
        "nixl: NIXL required (requests fail without it).",
    )
    nixl_staging_bytes: ByteSize = Field(
        default=64 << 20, description="Registered staging memory that NIXL frames go through."
    )
    overwrite: bool = Field(
        default=False,
        description="false (default): a chunk the server holds is kept (chunk keys name their bytes; "
        "nobody, the same tenant included, replaces what was stored first); true: a put replaces it.",
    )
    max_batch_keys: int = Field(default=256, ge=1, le=65536, description="Keys per request.")
    max_batch_bytes: ByteSize = Field(
        default=32 << 20, gt=0, description="Value bytes per part of a job (parts run on any connection)."
    )
    pipeline_depth: int = Field(
        default=2, ge=1, le=8,
        description="TCP requests in flight per connection: the next is checksummed and sent while the "
        "server handles the one before (1: one at a time). Not used over NIXL.",
    )
    pipeline_request_bytes: ByteSize = Field(
        default=4 << 20, gt=0,
        description="Value bytes per request when pipelining: a larger part goes as several requests.",
    )
    client_name: str = Field(default="", max_length=128, description="Shown by tiercache inspect.")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_address(value)
        return value

    def tls_context(self) -> ssl.SSLContext | None:
        """The client TLS context of ``tls`` (None: plaintext); one per backend, shared by its threads."""
        return client_context(self.tls) if self.tls is not None else None
