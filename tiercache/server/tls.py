"""TLS for the cache server's control channel: the config sections and the ``ssl`` contexts they build.

Standard library :mod:`ssl` only. :class:`ServerTlsConfig` is the server's
``tls:`` section (its certificate and key, and optionally a CA whose client
certificates it requires: mutual TLS); :class:`ClientTlsConfig` is a client's
(the CA it trusts, its own certificate for mutual TLS, the name the server's
certificate must carry). Both check at validation time that their files load
(a bad path or a key that does not match its certificate is a config error
naming the key, before any socket is bound); :func:`server_context` and
:func:`client_context` build the contexts used at run time: TLS 1.2 at least,
certificates always verified by the client (hostname included), by the
server only with ``client_ca_file``. Private keys must be unencrypted PEM
files (protect them with file permissions); nothing here logs a key or
echoes file contents.

With the NIXL data path only the control channel (HELLO, requests, replies)
runs over TLS; the values themselves move over NIXL/UCX, which this does not
encrypt.

Threading: the models are immutable; a context may be shared by any threads.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, FilePath, model_validator


def _load_error(exc: Exception) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__


class ServerTlsConfig(BaseModel):
    """The server's ``tls:`` section (unset: plaintext TCP)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: FilePath = Field(description="PEM certificate (chain) the server presents.")
    key_file: FilePath = Field(description="PEM private key of cert_file (unencrypted; keep it 0600).")
    client_ca_file: FilePath | None = Field(
        default=None,
        description="PEM CA bundle: when set, every client must present a certificate it signed "
        "(mutual TLS), in addition to its token.",
    )

    @model_validator(mode="after")
    def _loads(self) -> ServerTlsConfig:
        server_context(self)  # raises ValueError naming the key
        return self


class ClientTlsConfig(BaseModel):
    """A client's ``tls:`` options (unset: plaintext TCP)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: FilePath | None = Field(
        default=None, description="PEM CA bundle that signed the server's certificate (unset: the system's CAs)."
    )
    cert_file: FilePath | None = Field(
        default=None, description="This client's PEM certificate, for a server with client_ca_file (mutual TLS)."
    )
    key_file: FilePath | None = Field(default=None, description="PEM private key of cert_file (unencrypted).")
    server_name: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="Name (or IP) the server's certificate must carry; unset: the host of the address.",
    )

    @model_validator(mode="after")
    def _loads(self) -> ClientTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file: set both (mutual TLS) or neither")
        client_context(self)  # raises ValueError naming the key
        return self


def _base(purpose: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def server_context(config: ServerTlsConfig) -> ssl.SSLContext:
    """The server's context; ValueError naming the key whose file does not load."""
    ctx = _base(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(config.cert_file), str(config.key_file))
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"cert_file/key_file: cannot load the certificate and key: {_load_error(exc)}") from None
    if config.client_ca_file is not None:
        _load_ca(ctx, config.client_ca_file, "client_ca_file")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(config: ClientTlsConfig) -> ssl.SSLContext:
    """A client's context (server certificate and name always verified); ValueError naming the key."""
    ctx = _base(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED by default
    if config.ca_file is not None:
        _load_ca(ctx, config.ca_file, "ca_file")
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if config.cert_file is not None and config.key_file is not None:
        try:
            ctx.load_cert_chain(str(config.cert_file), str(config.key_file))
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"cert_file/key_file: cannot load the certificate and key: {_load_error(exc)}") from None
    return ctx


def _load_ca(ctx: ssl.SSLContext, path: Path, key: str) -> None:
    try:
        ctx.load_verify_locations(cafile=str(path))
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"{key}: cannot load the CA bundle: {_load_error(exc)}") from None
