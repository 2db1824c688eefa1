"""The cache-server tier's options (``options:`` of a ``backend: server`` tier in YAML).

Plain validated data, read by :class:`~tiercache.backends.server.backend.ServerBackend`
and its I/O threads (:mod:`tiercache.backends.server.worker`); the address is
checked here, when the configuration is read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from tiercache.backend import BackendSettings
from tiercache.config.schema import ByteSize
from tiercache.server.client import parse_address


class ServerSettings(BackendSettings):
    """Options of a ``backend: server`` tier."""

    address: str = Field(description="HOST:PORT of the cache server (tiercache serve).")
    token: SecretStr | None = Field(default=None, description="The server's auth_token, if it has one.")
    connections: int = Field(default=2, ge=1, le=32, description="TCP connections (one I/O thread each).")
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
        default=64 << 20, description="Registered staging memory for views outside registered buffers."
    )
    overwrite: bool = Field(
        default=True,
        description="A put replaces a chunk the server holds; false: held chunks are kept "
        "(chunk keys name their bytes, so engines may skip the rewrite).",
    )
    max_batch_keys: int = Field(default=256, ge=1, le=65536, description="Keys per request.")
    max_batch_bytes: ByteSize = Field(default=32 << 20, gt=0, description="Value bytes per request.")
    client_name: str = Field(default="", max_length=128, description="Shown by tiercache inspect.")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_address(value)
        return value
