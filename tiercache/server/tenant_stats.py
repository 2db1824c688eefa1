"""What STATS and HEALTH show a tenant: its own connections and counters, nothing of the others.

An admin tenant (and every client of a server with ``auth: none``) gets the
whole server's :class:`~tiercache.server.protocol.StatsReply` unchanged. A
non-admin tenant gets a *tenant view* (``tenant_view`` names it):

* the server's identity and configuration (name, version, uptime, draining,
  ``max_value_bytes``, each tier's name, backend and capacity) as they are;
* ``get_keys``, ``hits``, ``misses``, ``put_keys``: the tenant's own, summed
  over its connections, open and closed (:class:`TenantTotals`);
* store-wide occupancy and activity, which would reveal what other tenants
  do (``used_bytes``, ``stored``, ``refused_messages``, each tier's used
  bytes, chunks, hits, stores, evictions): 0;
* ``clients``: the tenant's own connections only.

HEALTH's connection count is likewise the tenant's own.

Threading: event loop thread only (the server's STATS and forget paths).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec

from tiercache.server import protocol as p
from tiercache.server.tenants import Tenant

_COUNTERS = ("get_keys", "hits", "misses", "put_keys")


class _Counted(Protocol):
    get_keys: int
    hits: int
    misses: int
    put_keys: int


class _Conn(Protocol):
    tenant: Tenant | None


C = TypeVar("C", bound=_Conn)


@dataclass
class _Totals:
    get_keys: int = 0
    hits: int = 0
    misses: int = 0
    put_keys: int = 0


def visible(connections: Iterable[C], tenant: Tenant | None) -> list[C]:
    """The connections ``tenant`` may see: all for an admin, else its own (authenticated) ones."""
    if tenant is None:
        return []
    if tenant.admin:
        return list(connections)
    return [c for c in connections if c.tenant is not None and c.tenant.name == tenant.name]


class TenantTotals:
    """Counters of each tenant's closed connections (one entry per configured tenant name)."""

    def __init__(self) -> None:
        self._closed: dict[str, _Totals] = {}

    def add_closed(self, tenant: Tenant | None, stats: _Counted) -> None:
        """A connection of ``tenant`` closed: keep its counters (unauthenticated ones count for nobody)."""
        if tenant is None:
            return
        totals = self._closed.setdefault(tenant.name, _Totals())
        for name in _COUNTERS:
            setattr(totals, name, getattr(totals, name) + getattr(stats, name))

    def of(self, tenant: Tenant, open_stats: Iterable[_Counted]) -> dict[str, int]:
        """The tenant's counters: its closed connections' plus ``open_stats`` (its open ones)."""
        base = self._closed.get(tenant.name, _Totals())
        out = {name: getattr(base, name) for name in _COUNTERS}
        for stats in open_stats:
            for name in _COUNTERS:
                out[name] += getattr(stats, name)
        return out


def tenant_view(full: p.StatsReply, tenant: Tenant, clients: list[p.ClientStats],
                counters: dict[str, int]) -> p.StatsReply:
    """``full`` as the non-admin ``tenant`` may see it (see the module docstring)."""
    tiers = [
        msgspec.structs.replace(t, used_bytes=0, chunks=0, hit_chunks=0, stored_chunks=0, evictions=0)
        for t in full.tiers
    ]
    return msgspec.structs.replace(
        full, used_bytes=0, stored=0, refused_messages=0, tiers=tiers, clients=clients,
        tenant_view=tenant.name, **counters,
    )
