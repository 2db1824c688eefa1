"""Who a cache-server connection acts for: its tenant, and the key space that tenant may touch.

A connection's tenant is fixed at HELLO (by the token it presented,
:mod:`tiercache.server.auth`) and never changes. Every key a tenant names is
scoped into that tenant's *space* before it reaches the store
(:meth:`Tenant.scoped`, applied to every request body by
:func:`scope_request`), so one tenant can neither read, overwrite, delete nor
see another's chunks, over TCP or NIXL alike. Tenants that share a ``space``
share their chunks (one team, several tokens). A space is the first
``SPACE_BYTES`` of a digest of its name (:func:`space_of`); the server's key
bound shrinks by that much for the tenant (:func:`limits_for`), so a scoped
key still fits the store.

Threading: immutable values and pure functions; any thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from tiercache.server import protocol as p

SPACE_BYTES = 8  # bytes prefixed to every key of a tenant (a digest of its space's name)
#: The one tenant of a server with ``auth: none`` (loopback only): every client, keys unchanged.
OPEN_TENANT_NAME = "default"

B = TypeVar("B", bound=p._Body)


@dataclass(frozen=True)
class Tenant:
    """One authenticated client identity.

    ``name`` is shown in STATS and metrics; ``space`` is the key prefix
    (``SPACE_BYTES`` long, or empty when the server runs with ``auth: none``:
    one implicit tenant, keys unchanged); ``admin`` may see every tenant's
    connections in STATS (``tiercache inspect``).
    """

    name: str
    space: bytes
    admin: bool = False

    def scoped(self, key: bytes) -> bytes:
        """The store's key for this tenant's ``key``."""
        return self.space + key

    def unscoped(self, key: bytes) -> bytes:
        """The tenant's key for a store key of its space (the store's key minus the prefix)."""
        return key[len(self.space):]


def space_of(name: str) -> bytes:
    """The key prefix of the space called ``name`` (``SPACE_BYTES`` of a SHA-256 digest)."""
    return hashlib.sha256(b"tiercache-tenant-space\0" + name.encode("utf-8")).digest()[:SPACE_BYTES]


def open_tenant() -> Tenant:
    """The implicit tenant of ``auth: none``: empty space (keys as the client sent them), admin."""
    return Tenant(OPEN_TENANT_NAME, b"", admin=True)


def scope_request(tenant: Tenant | None, body: B) -> B:
    """``body`` with every key it names scoped into ``tenant``'s space (bodies without keys as is).

    Applied once per request, after the body was decoded and checked against
    the tenant's limits and before any handler sees it: EXISTS, PUT, GET,
    DELETE, PUT_REMOTE and GET_REMOTE all carry ``keys``; nothing else names a
    key. ``tenant`` None (before HELLO) or an empty space leave the body as is.
    """
    keys: list[bytes] | None = getattr(body, "keys", None)
    if tenant is None or not tenant.space or keys is None:
        return body
    space = tenant.space
    return msgspec.structs.replace(body, keys=[space + k for k in keys])


def limits_for(limits: p.Limits, tenant: Tenant) -> p.Limits:
    """The server's limits as a tenant sees them: keys shorter by its space's prefix."""
    if not tenant.space:
        return limits
    return dataclasses.replace(limits, max_key_bytes=limits.max_key_bytes - len(tenant.space))
